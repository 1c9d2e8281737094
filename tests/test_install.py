"""The Quickstart's `pip install -r requirements.txt` takes torch's CPU build: PyTorch's CPU index on Linux, where
PyPI's torch is the CUDA build (several GB of NVIDIA packages); PyPI's wheel, a CPU build, on macOS and Windows."""
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PLATFORMS = {  # platform: (the marker variables requirements.txt may use there, the torch pin that must apply)
    "linux-x86_64": (dict(sys_platform="linux", platform_system="Linux", platform_machine="x86_64"), "==2.13.0+cpu"),
    "linux-aarch64": (dict(sys_platform="linux", platform_system="Linux", platform_machine="aarch64"), "==2.13.0+cpu"),
    "macos-arm64": (dict(sys_platform="darwin", platform_system="Darwin", platform_machine="arm64"), "==2.13.0"),
    "windows-amd64": (dict(sys_platform="win32", platform_system="Windows", platform_machine="AMD64"), "==2.13.0"),
}


def requirement_lines() -> list[str]:
    lines = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    return [line for line in lines if line]


@pytest.mark.parametrize("platform", PLATFORMS)
def test_each_platform_gets_one_torch_pin_and_the_cpu_index(platform):
    environment, pin = PLATFORMS[platform]
    requirements = [Requirement(line) for line in requirement_lines() if not line.startswith("-")]
    torch = [r for r in requirements if r.name == "torch"]
    chosen = [str(r.specifier) for r in torch if r.marker is None or r.marker.evaluate(environment)]
    assert chosen == [pin]
    assert f"--extra-index-url {CPU_INDEX}" in requirement_lines()


def fake_index(root: Path, *wheels: str) -> str:
    """A PEP 503 simple index holding empty torch wheels (metadata only), as a file:// URL."""
    folder = root / "simple" / "torch"
    folder.mkdir(parents=True)
    links = []
    for wheel in wheels:
        version = wheel.split("-")[1]
        with zipfile.ZipFile(folder / wheel, "w") as whl:
            info = f"torch-{version}.dist-info"
            whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
            whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
            whl.writestr(f"{info}/RECORD", "")
        links.append(f'<a href="{wheel.replace("+", "%2B")}">{wheel}</a>')
    (folder / "index.html").write_text(f"<html><body>{''.join(links)}</body></html>")
    return (root / "simple").as_uri()


@pytest.mark.skipif(sys.platform != "linux", reason="the CUDA build is PyPI's torch on Linux only")
def test_pip_takes_torch_from_the_cpu_index_not_pypi(tmp_path):
    # pip's own resolver, offline: a stand-in PyPI with torch 2.13.0 (the CUDA build there), a stand-in CPU index
    # with 2.13.0+cpu, and requirements.txt's index and torch lines pointing at them. --isolated drops PIP_*
    # variables and the user's configuration, PIP_CONFIG_FILE=/dev/null the machine's (wheel folders, indexes).
    pypi = fake_index(tmp_path / "pypi", "torch-2.13.0-py3-none-any.whl")
    cpu = fake_index(tmp_path / "cpu", "torch-2.13.0+cpu-py3-none-any.whl")
    lines = [line.replace(CPU_INDEX, cpu) for line in requirement_lines() if line.startswith(("torch", "--"))]
    (tmp_path / "requirements.txt").write_text("\n".join(lines) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "--isolated", "--disable-pip-version-check", "--quiet",
                    "--dry-run", "--ignore-installed", "--no-deps", "--index-url", pypi, "--report",
                    str(tmp_path / "report.json"), "-r", str(tmp_path / "requirements.txt")],
                   env={**os.environ, "PIP_CONFIG_FILE": os.devnull}, check=True, timeout=120)
    [torch] = json.loads((tmp_path / "report.json").read_text())["install"]
    assert torch["metadata"]["version"] == "2.13.0+cpu"
    assert torch["download_info"]["url"].startswith(cpu)
