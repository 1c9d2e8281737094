"""An idle server should cost the box nothing: Gradio's queue finds new work by polling, by default 1,000 times a
second."""

# Gradio 6.31's queue loop sleeps this long whenever it finds no event to start: 1 ms on Linux and macOS, where
# it cost an idle server 11-14% of a core on the development machine (python -m qvl.stress), and 50 ms on Windows.
# A new request waits at most this long before it starts.
QUEUE_POLL_S = 0.05
# Its progress loop forwards gr.Progress updates, which this app does not use, every 10 ms (Windows: 100 ms).
PROGRESS_POLL_S = 0.1


def quiet_queue(demo):
    """Make demo's queue poll at Gradio's Windows pace on every system; call it between demo.queue() (which makes
    the queue) and launch(). Returns demo."""
    demo._queue.sleep_when_free = QUEUE_POLL_S
    demo._queue.progress_update_sleep_when_free = PROGRESS_POLL_S
    return demo
