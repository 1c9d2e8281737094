"""An idle server leaves the CPU to the answers: Gradio's queue, left alone, polls for work 1,000 times a second."""
from qvl.tools import stress


def test_an_idle_server_uses_under_3_percent_of_a_core(launch_app, tmp_path):
    # A resource bound, not a speed target: the server's own CPU time, which other processes on the box barely move.
    # With Gradio's 1 ms poll it used 11-14% of a core on the development machine; with qvl.serve.idle's, about 1%.
    with launch_app() as app:
        app.wait_settled()  # a first start compiles numba's kernels in the background: start-up, not idleness
        percent = stress.idle_cpu(app.url, None, app.proc.pid, tmp_path, seconds=10)
    assert percent < 3
