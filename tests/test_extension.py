"""The C++ extension's life cycle (torch_tpu.core.extension): built once per torch, Python and
source, into a per-user cache, at the first import that finds none; where it cannot be, the package
loads without it and says once why and what is lost. The real build is exercised by the set-up
command and by ``tools/check_install.py`` (an sdist installed into a fresh venv, see .ci/run);
these tests stub the build and never compile."""

from __future__ import annotations

import warnings

import pytest
import torch

from torch_tpu.core import extension as _extension


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """A process state in which nothing was loaded yet, with its own empty cache."""
    monkeypatch.setenv("TORCH_TPU_EXTENSION_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCH_TPU_NO_EXTENSION", raising=False)
    monkeypatch.setattr(_extension, "_loaded", [])
    monkeypatch.setattr(_extension, "_why", [])
    return tmp_path


def _load_recording() -> tuple[object, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        module = _extension.load()
    return module, [w for w in seen if issubclass(w.category, _extension.ExtensionWarning)]


def test_without_a_compiler_the_package_loads_and_says_once_what_is_lost(fresh, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-for-torch-tpu")
    monkeypatch.setattr(_extension, "build", lambda verbose=False: pytest.fail("no build may start"))
    module, said = _load_recording()
    assert module is None and not _extension.available()
    assert "no C++ compiler" in _extension.why_not() and "no-such-compiler-for-torch-tpu" in _extension.why_not()
    assert len(said) == 1
    message = str(said[0].message)
    assert "no C++ compiler" in message and "torch.Generator(device='tpu')" in message and "nested" in message
    assert _extension.load() is None  # once per process: a second call neither warns nor retries
    # the rest of the package is unaffected: a CPU generator seeds tpu random ops
    a = torch.randn(4, device="tpu", generator=torch.Generator().manual_seed(1))
    b = torch.randn(4, device="tpu", generator=torch.Generator().manual_seed(1))
    assert torch.equal(a.cpu(), b.cpu())


def test_turned_off_it_is_neither_built_nor_loaded_and_nothing_is_said(fresh, monkeypatch):
    monkeypatch.setenv("TORCH_TPU_NO_EXTENSION", "1")
    monkeypatch.setattr(_extension, "build", lambda verbose=False: pytest.fail("no build may start"))
    module, said = _load_recording()
    assert module is None and said == []
    assert "TORCH_TPU_NO_EXTENSION=1" in _extension.why_not()


def test_a_missing_build_is_built_at_first_load_and_a_failed_one_is_not_retried(fresh, monkeypatch, capsys):
    """No build in the cache: the first load builds (saying so on stderr); a build that failed
    leaves its reason in its folder, and later processes report it instead of compiling again."""
    monkeypatch.setattr(_extension, "cannot_build", lambda: None)
    calls = []

    def failing_build(verbose=False):
        calls.append(1)
        where = _extension.build_dir()
        where.mkdir(parents=True)
        (where / "build-failed.txt").write_text("the build failed (exit status 1):\nerror: boom\n")
        raise RuntimeError(f"the build failed in {where} (exit status 1)")

    monkeypatch.setattr(_extension, "build", failing_build)
    module, said = _load_recording()
    assert module is None and calls == [1]
    assert "building the C++ extension" in capsys.readouterr().err
    assert "the build failed" in str(said[0].message)

    monkeypatch.setattr(_extension, "_loaded", [])  # as a later process
    module, said = _load_recording()
    assert module is None and calls == [1]
    assert "an earlier build failed" in _extension.why_not() and "to retry" in str(said[0].message)


def test_a_build_that_does_not_load_is_reported(fresh, monkeypatch):
    where = _extension.build_dir()
    where.mkdir(parents=True)
    (where / "torch_tpu_C.so").write_bytes(b"not a shared library")
    module, said = _load_recording()
    assert module is None and "did not load" in _extension.why_not() and len(said) == 1


def test_each_torch_python_and_source_builds_in_its_own_folder(fresh, tmp_path, monkeypatch):
    """One cache serves several venvs and package versions: the folder names the torch and Python
    it was built against, and a changed source gets a new folder, not a stale library."""
    here = _extension.build_dir()
    assert here.parent == tmp_path / "cache"
    assert here.name.startswith(f"torch-{torch.__version__}-py3") and here.name.count("-") == 3
    sources = []
    for source in _extension._SOURCES:
        copy = tmp_path / source.name
        copy.write_bytes(source.read_bytes())
        sources.append(copy)
    monkeypatch.setattr(_extension, "_SOURCES", sources)
    assert _extension.build_dir() == here
    sources[0].write_bytes(sources[0].read_bytes() + b"\n// changed\n")
    assert _extension.build_dir() != here
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    assert "torch-2.99.0-" in _extension.build_dir().name


def test_the_builds_stay_put_when_the_program_cache_moves(monkeypatch, tmp_path):
    """A process given a fresh program cache (TORCH_TPU_CACHE_DIR) still finds the extension."""
    monkeypatch.delenv("TORCH_TPU_EXTENSION_DIR", raising=False)
    home = _extension.cache_root()
    assert home.parts[-3:] == (".cache", "torch_tpu", "extension")
    monkeypatch.setenv("TORCH_TPU_CACHE_DIR", str(tmp_path))
    assert _extension.cache_root() == home
    monkeypatch.setenv("TORCH_TPU_EXTENSION_DIR", str(tmp_path / "builds"))
    assert _extension.cache_root() == tmp_path / "builds"


def test_without_a_ninja_or_python_headers_the_reason_names_it(monkeypatch):
    import shutil

    real_which = shutil.which
    monkeypatch.setattr(_extension, "_ninja_on_path", lambda: None)
    monkeypatch.setattr(_extension.shutil, "which", lambda name: None if name == "ninja" else real_which(name))
    assert "ninja" in (_extension.cannot_build() or "")
