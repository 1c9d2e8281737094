"""python -m qvl.stress as a user runs it: every scenario, small, against the tiny model it launches itself."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_stress_run_with_answers_decoded_together_answers_everything_and_prints_its_figures():
    # Three seats (--batch 3) for five clients; the run through a second app below keeps the default of one.
    done = subprocess.run(
        [sys.executable, "-m", "qvl.stress", "--batch", "3", "--clients", "5", "--soak", "8", "--new-client-every",
         "4", "--max-sessions", "6", "--queue-size", "4", "--kv-memory", "8MB", "--idle", "2", "--cached-repeats", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "batch 3" in done.stdout
    lost = {line.split("|")[0].strip(): line.split("|")[5].strip() for line in done.stdout.splitlines() if "|" in line}
    assert lost == {"scenario": "lost", "load": "0", "soak": "0", "faults": "0"}
    assert re.search(r"idle: [0-9.]+% of one core, [0-9]+ wake-ups a second, over 2 s", done.stdout)
    assert "cached repeat via gradio_client, 3 runs: p50" in done.stdout
    assert "cached repeat via HTTP /gradio_api/call/ask, 3 runs: p50" in done.stdout
    assert "SIGTERM: exit code 0" in done.stdout and "freed" in done.stdout


def test_the_stress_run_through_a_second_app_in_front_of_the_first_answers_everything():
    done = subprocess.run(
        [sys.executable, "-m", "qvl.stress", "--backend", "--clients", "3", "--soak", "6", "--new-client-every", "3",
         "--max-sessions", "4", "--queue-size", "4", "--idle", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "as the backend" in done.stdout and "in front of it (--backend http://127.0.0.1:" in done.stdout
    lost = {line.split("|")[0].strip(): line.split("|")[5].strip() for line in done.stdout.splitlines() if "|" in line}
    assert lost == {"scenario": "lost", "load": "0", "soak": "0", "faults": "0"}
    assert "SIGTERM: exit code 0" in done.stdout and "SIGTERM to the backend: exit code 0" in done.stdout


HELP = """
import runpy, sys
for module in sys.argv[1:]:
    sys.argv = [module, "--help"]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        print(f"{module} exited with {e.code}", flush=True)
"""


def test_every_command_explains_itself():
    # As `python -m module --help` runs each, in one process: three would import torch and transformers three times.
    modules = ["qvl.stress", "qvl.bench", "qvl.tiny"]
    done = subprocess.run([sys.executable, "-c", HELP, *modules], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    for module in modules:
        assert f"usage: python -m {module}" in done.stdout and f"{module} exited with 0" in done.stdout


def test_the_tiny_model_command_writes_a_loadable_checkpoint(tmp_path):
    done = subprocess.run([sys.executable, "-m", "qvl.tiny", str(tmp_path / "tiny")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and (tmp_path / "tiny" / "model.safetensors").exists()
