"""An idle server leaves the CPU to the answers: Gradio's queue, left alone, polls for work 1,000 times a second."""
from qvl.tools import stress


def test_an_idle_server_wakes_a_few_dozen_times_a_second(launch_app, tmp_path):
    # A resource bound, not a speed target: the server's threads' wake-ups, which cause its idle CPU time and, unlike
    # it, do not scale with the CPU's speed or move with other processes on the box. With Gradio's 1 ms poll the
    # server woke 863 times a second (8.1% of a core on an AMX Xeon); with qvl.serve.idle's, 40 (2.9%), where
    # a slower CI machine's 3.2% of a core failed the CPU-time bound this test had.
    with launch_app() as app:
        app.wait_settled()  # a first start compiles numba's kernels in the background: start-up, not idleness
        percent, wakeups = stress.idle(app.url, None, app.proc.pid, tmp_path, seconds=5)
    assert wakeups < 150, f"{wakeups:.0f} wake-ups a second, {percent:.1f}% of a core"
