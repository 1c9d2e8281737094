"""Chat about images with Qwen3-VL on a CPU: `python app.py` (flags: `python app.py --help`, or QVL_* env vars)."""
import logging
import signal

from qvl import cache, cpu, heap, idle, settings, ui
from qvl.engine import Engine

log = logging.getLogger("qvl")


def main():
    heap.limit_arenas()  # before the model, the server and their threads
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # Gradio's own start-up probes, one line each
    config = settings.parse()
    auth = None
    if config.auth:
        user, sep, password = config.auth.partition(":")
        if not (sep and user and password):
            raise SystemExit("--auth / QVL_AUTH must look like user:password")
        auth = (user, password)
    log.info("CPU: %s", cpu.describe())
    engine = Engine(config)
    if engine.fallback:
        log.warning("\n%s\n!! OFFLINE FALLBACK: %s\n!! The tiny random model answers; its answers are gibberish.\n%s",
                    "!" * 100, engine.fallback, "!" * 100)
    log.info("model %s, %s, %d threads", engine.model_id, engine.precision, engine.threads)
    answers = cache.AnswerCache(config.cache_dir, config.cache_size, enabled=config.cache)
    demo = ui.build(engine, answers, config)
    # SIGTERM (docker stop, Spaces restarts, systemd) closes the server the way Ctrl+C does, and exits 0.
    signal.signal(signal.SIGTERM, lambda *_: demo.close())
    idle.quiet_queue(demo.queue(default_concurrency_limit=1, max_size=config.queue_size)).launch(
        server_name=config.host, server_port=config.port, share=config.share, auth=auth,
        max_file_size=config.max_file_size, state_session_capacity=config.max_sessions, i18n=ui.I18N,
    )


if __name__ == "__main__":
    main()
