"""Finding the CUDA runtime torch loaded, from the process's memory map (no GPU needed: the map is given)."""

from __future__ import annotations

import io

import pytest
import torch

from kvcanary.runtime import cuda_calls

LINE = "7f00a000-7f00b000 r-xp 00000000 08:01 {inode:<8} {path}\n"


def maps_of(*paths: str) -> str:
    return "".join(LINE.format(inode=i + 100, path=p) for i, p in enumerate(paths))


def given_map(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    """The module reads ``text`` as the process's memory map."""
    monkeypatch.setattr(cuda_calls, "open", lambda *a, **k: io.StringIO(text), raising=False)


@pytest.mark.parametrize(
    ("paths", "want"),
    [
        (("/usr/lib/libc.so.6", "/venv/nvidia/cuda_runtime/lib/libcudart.so.13", "[stack]"),
         "/venv/nvidia/cuda_runtime/lib/libcudart.so.13"),
        (("/opt/my libs/libcudart.so.12",), "/opt/my libs/libcudart.so.12"),  # a path with a space
        (("/usr/lib/libc.so.6", "/opt/libcudart_static_notes.txt", "[heap]"), None),
        (("/usr/lib/libc.so.6",) * 2000 + ("/last/libcudart.so",), "/last/libcudart.so"),  # the last line, no newline
        ((), None),
    ],
)  # fmt: skip
def test_the_loaded_runtime_is_found_in_the_memory_map(
    monkeypatch: pytest.MonkeyPatch, paths: tuple[str, ...], want: str | None
) -> None:
    text = maps_of(*paths).rstrip("\n") if paths and paths[-1] == "/last/libcudart.so" else maps_of(*paths)
    given_map(monkeypatch, text)
    assert cuda_calls._loaded_cudart() == want


def test_no_memory_map_means_no_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a: object, **k: object) -> io.StringIO:
        raise OSError("no /proc here")

    monkeypatch.setattr(cuda_calls, "open", refuse, raising=False)
    assert cuda_calls._loaded_cudart() is None


def test_a_library_is_opened_only_when_the_process_has_loaded_it() -> None:
    assert cuda_calls._resident("libc.so.6") is not None  # every CPython on Linux has it loaded
    assert cuda_calls._resident("libkvcanary_never_built.so.1") is None


def test_the_runtime_is_found_by_its_path_where_its_soname_is_not_resident(monkeypatch: pytest.MonkeyPatch) -> None:
    """Torch's CUDA version names a runtime not loaded here: the memory map is searched, and a path it names that is
    not loaded either gives no runtime (and no library is loaded)."""
    monkeypatch.setattr(torch.version, "cuda", "99.0")
    for listed in ("/nowhere/libcudart.so.99", "/usr/lib/libc.so.6"):
        given_map(monkeypatch, maps_of(listed))
        assert cuda_calls._loaded_runtime() is None


def test_device_index_is_the_devices_own_or_else_the_current_devices() -> None:
    assert cuda_calls.device_index(torch.device("cuda", 3)) == 3  # named: no CUDA call, so this runs on the CPU too
    if torch.cuda.is_available():  # unnamed: torch's stubs say int, the value is None (the compiled build refused it)
        assert torch.device("cuda").index is None
        assert cuda_calls.device_index(torch.device("cuda")) == torch.cuda.current_device()
