"""The engine: Qwen3-VL loaded once and quantized for this CPU (local), or a server asked over HTTP (remote).

Kept free of imports: app.py reads cpu and heap from here before torch loads."""
