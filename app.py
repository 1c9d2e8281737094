"""Chat about images with Qwen3-VL on a CPU: `python app.py` (flags: `python app.py --help`, or QVL_* env vars)."""
import logging
import os
import signal
import sys
import tempfile
import threading

from qvl import settings
from qvl.engine import cpu, heap  # light: --help and a flag error answer before torch and gradio load (seconds)

log = logging.getLogger("qvl")


def main():
    config = settings.parse()
    with own_temp_dir():  # before gradio is imported: it reads GRADIO_TEMP_DIR then
        stopped = run(config)
    if not stopped:  # Ctrl+C or SIGTERM while the weights load or numba compiles: nothing to save, no point to stop at
        log.info("exiting while the model loads or the kernels compile")
        logging.shutdown()
        os._exit(0)


def own_temp_dir() -> tempfile.TemporaryDirectory:
    """Gradio's folder for uploads and example pictures, this process's own: a fresh one inside GRADIO_TEMP_DIR (or
    the system's temporary folder), removed with everything in it when the process exits.

    Gradio names a file there by its content alone, and an app that stops deletes the files it put there, so in a
    folder shared by several apps one app's stop deleted another's uploads and examples. A folder left by a killed
    process stays, for the system's own clean-up: no process can be sure that another folder's owner is gone (a
    container sharing the volume has its own process ids), and deleting a live app's files is what this prevents.
    """
    base = os.environ.get("GRADIO_TEMP_DIR") or tempfile.gettempdir()
    try:
        os.makedirs(base, exist_ok=True)
        own = tempfile.TemporaryDirectory(prefix=f"qvl-{os.getpid()}-", dir=base, ignore_cleanup_errors=True)
    except OSError as e:
        sys.exit(f"qvl cannot make its folder for uploads in {base} ({e.strerror}): set GRADIO_TEMP_DIR to a "
                 "writable folder.")
    os.environ["GRADIO_TEMP_DIR"] = own.name
    return own


def run(config) -> bool:
    """Load, serve until Ctrl+C or SIGTERM, and stop; False when stopped while the weights load."""
    cpu.hold_collector()  # until the page is up
    heap.limit_arenas()  # before the model, the server and their threads
    heap.map_apart()  # before the model loads
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # Gradio's own start-up probes, one line each
    if not config.backend:
        from qvl.engine import modelcache

        sys.setswitchinterval(cpu.LOADING_SWITCH_S)  # until warmed up
        # A stored quantized model is read and packed (fbgemm releases the GIL) while the imports below run.
        ahead = modelcache.read_ahead(config)
    log.info("CPU: %s", cpu.describe())
    if config.backend:  # a model server elsewhere answers: no torch here
        from qvl.engine.remote import RemoteEngine

        engine = RemoteEngine(config)  # which logs its model once the backend names it
    else:
        from qvl.engine.local import Engine

        engine = Engine(config, ahead, background=True)  # the page serves while the weights load
        log.info("model %s, %s, %d threads", engine.model_id, engine.precision, engine.threads)
    if engine.fallback:
        log.warning("\n%s\n!! OFFLINE FALLBACK: %s\n!! The tiny random model answers; its answers are gibberish.\n%s",
                    "!" * 100, engine.fallback, "!" * 100)
    try:
        serve(engine, config)
    finally:
        stopped = engine.close()  # before the interpreter stops the thread pools that a background load may use
    return stopped


def serve(engine, config):
    """The page, the OpenAI API and the warm-up, until Ctrl+C or SIGTERM."""
    from qvl.serve import answers, cache, doors, idle, openai_api, tool, ui

    answerer = answers.Answerer(engine, cache.AnswerCache(config.cache_dir, config.cache_size, enabled=config.cache),
                                config)
    demo, guard = ui.build(answerer, config), doors.guard(config)
    # SIGTERM (docker stop, Spaces restarts, systemd) closes the server the way Ctrl+C does, and exits 0.
    signal.signal(signal.SIGTERM, lambda *_: demo.close())
    # Gradio's own start-up text suggests `share=True` in launch(); quiet, and the app says it in its own terms.
    idle.quiet_queue(demo.queue(default_concurrency_limit=1, max_size=config.queue_size)).launch(
        server_name=config.host, server_port=config.port, share=config.share,
        auth=settings.credentials(config.auth) or None, auth_message=ui.login_message(),
        max_file_size=ui.upload_ceiling(config), state_session_capacity=config.max_sessions, mcp_server=config.mcp,
        quiet=True, prevent_thread_lock=True, **ui.page_assets(),
        # Not Gradio's look at its own page before launch() returns: one HEAD request that gives up after 3 s, which a
        # start whose load keeps both cores busy made it do, and then the app stopped. Its own log says where it is.
        _frontend=False,
        # The OpenAI API on the same port; routes given to the app first are matched before Gradio's own. With
        # --api-key and no --auth, the key guards every door.
        app_kwargs={"routes": openai_api.routes(answerer, config), "middleware": guard},
    )
    if config.mcp:  # at once: the server already answers, and until then agents would be offered every endpoint
        tool.offer(demo)
    cpu.release_collector()  # the imports are done
    # The page serves at once and says it is warming up; questions asked meanwhile wait in line for the engine.
    threading.Thread(target=engine.warm_up, args=ui.warm_up_request(), name="warm-up", daemon=True).start()
    threading.Thread(target=lambda: engine.ready.wait() and sys.setswitchinterval(cpu.SERVING_SWITCH_S),
                     name="ready", daemon=True).start()  # the GIL's usual hand-over once the model is in and warmed up
    waiting = "" if engine.ready.is_set() else " (questions asked while the model loads and warms up wait in line)"
    if guard:  # no page for browsers: every client sends the key
        log.info("qvl is up at %s for clients that send the key%s", demo.local_url, waiting)
    else:
        log.info("qvl is up: open %s in a browser%s", demo.local_url, waiting)
    if config.mcp:
        log.info("MCP server (streamable HTTP): %s/gradio_api/mcp/", (demo.share_url or demo.local_url).rstrip("/"))
    if demo.share_url:
        log.info("public link (valid for a week, while this process runs): %s", demo.share_url)
    else:
        log.info("for a public link, start with --share (protect it with QVL_AUTH=user:password)")
    demo.block_thread()


if __name__ == "__main__":
    main()
