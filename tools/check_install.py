"""Installs torch_tpu as a user does, from the sdist, into a fresh venv, and checks that it works.

``python tools/check_install.py`` (``make install-check``; .ci/run runs it):

1. ``python -m build`` makes the sdist and the wheel (into ``dist/``); the wheel must hold the hook
   module and the extension's C++ sources.
2. A fresh venv sees the running interpreter's packages (torch, jax: "beside the installed torch",
   through a ``.pth`` file, so nothing is downloaded again) and gets the sdist by ``pip install
   --no-deps``: pip builds it there, as it does for a user.
3. In a folder outside the checkout, with an empty extension cache: ``import torch_tpu`` builds the
   C++ extension and loads it, and the demo trains.

Prints what it did with the seconds each step took, and exits non-zero at the first failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    started = time.monotonic()
    done = subprocess.run(cmd, text=True, capture_output=True, **kw)
    took = time.monotonic() - started
    shown = " ".join(str(c)[:50] for c in cmd[:4])
    print(f"check_install: {shown} ... exit {done.returncode} in {took:.0f} s", flush=True)
    if done.returncode != 0:
        print(done.stdout[-4000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
        raise SystemExit(f"check_install: failed: {' '.join(str(c) for c in cmd)}")
    return done


def main() -> int:
    dist = ROOT / "dist"
    for old in dist.glob("torch_tpu-*"):
        old.unlink()
    _run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(dist), str(ROOT)])
    sdist = next(dist.glob("torch_tpu-*.tar.gz"))
    wheel = next(dist.glob("torch_tpu-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    wanted = ["_torch_tpu_autoload.py", "torch_tpu/csrc/generator.cpp", "torch_tpu/core/extension.py"]
    missing = [n for n in wanted if n not in names]
    if missing:
        raise SystemExit(f"check_install: {wheel.name} lacks {missing}")
    print(f"check_install: {sdist.name} and {wheel.name} ({len(names)} files)")

    with tempfile.TemporaryDirectory(prefix="torch_tpu_install_") as tmp:
        tmp_path = Path(tmp)
        venv = tmp_path / "venv"
        _run([sys.executable, "-m", "venv", str(venv)])
        python = venv / "bin" / "python"
        where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        site = Path(_run([str(python), "-c", where]).stdout.strip())
        # beside the installed torch: this interpreter's packages, after the venv's own (a .pth
        # line is a plain path entry, so the checkout's editable install there is not activated)
        (site / "beside_torch.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        _run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(sdist)])
        work = tmp_path / "elsewhere"
        work.mkdir()
        env = {**os.environ, "TORCH_TPU_EXTENSION_DIR": str(tmp_path / "extension-cache"),
               "TORCH_TPU_PLATFORM": "cpu", "PYTHONPATH": ""}
        env.pop("TORCH_TPU_NO_EXTENSION", None)
        probe = ("import torch, torch_tpu, torch_tpu.core.extension as e; "
                 f"assert torch_tpu.__file__.startswith({str(site)!r}), torch_tpu.__file__; "
                 "assert e.available(), e.why_not(); "
                 "print('installed at', torch_tpu.__file__, '; extension in', e.build_dir()); "
                 "print(torch.Generator(device='tpu').device)")
        print(_run([str(python), "-c", probe], cwd=work, env=env).stdout.strip())
        demo = _run([str(python), str(ROOT / "examples" / "demo.py")], cwd=work, env=env).stdout
        trained = [line for line in demo.splitlines() if "test accuracy" in line]
        if not trained or float(trained[0].rsplit(" ", 1)[1].rstrip("%")) < 90:
            raise SystemExit(f"check_install: the demo did not train: {trained or demo[-2000:]}")
        print(f"check_install: the demo: {trained[0]}")
    print("check_install: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
