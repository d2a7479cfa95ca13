"""Bad arguments and failing systems: one line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from waste import cli
from waste.cli import main
from waste.testing import tiny_container


@pytest.fixture(scope="module")
def container(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_container(tmp_path_factory)


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], code: int = 2) -> str:
    got = main(argv)
    err = capsys.readouterr().err.strip()
    assert got == code, (argv, err)
    assert err.startswith("waste: ") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("exc", [
    PermissionError(errno.EACCES, "Permission denied", "/x/y"),
    IsADirectoryError(errno.EISDIR, "Is a directory", "/x"),
    NotADirectoryError(errno.ENOTDIR, "Not a directory", "/x/y"),
    OSError(errno.ELOOP, "Too many levels of symbolic links", "/loop"),
    OSError(errno.ENOSPC, "No space left on device", "/full/f.npy"),
    OSError(errno.EBUSY, "Device or resource busy", "/busy", None, "/busy2"),
    OSError(errno.EIO, "Input/output error"),
])
def test_every_os_error_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                    exc: OSError) -> None:
    def handler(args: object) -> int:
        raise exc

    monkeypatch.setattr(cli.importlib, "import_module", lambda name: type("M", (), {"cmd_info": handler}))
    err = one_line_error(capsys, ["info", "x.waste"])
    assert exc.strerror in err
    if exc.filename:
        assert str(exc.filename) in err


def test_real_os_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], container: Path) -> None:
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    assert "loop" in one_line_error(capsys, ["info", str(loop)])
    afile = tmp_path / "f"
    afile.write_text("x")
    assert "not a container directory" in one_line_error(capsys, ["info", str(afile / "sub")])
    err = one_line_error(capsys, ["run", str(container), "--prompt-file", str(tmp_path), "--max-new", "1"])
    assert "not a regular file" in err


def test_stdout_on_a_full_device() -> None:
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "waste.cli", "plan", "tiny"], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == "waste: error: No space left on device", proc.stderr


@pytest.mark.parametrize("argv", [
    ["synth", "tiny", "out", "--seed", "-1"],
    ["run", "C", "--prompt-ids", "1", "--seed", "-1"],
    ["run", "C", "--prompt-ids", "1", "--temperature", "nan"],
    ["run", "C", "--prompt-ids", "1", "--temperature", "-1"],
    ["run", "C", "--prompt-ids", "1", "--top-p", "0"],
    ["run", "C", "--prompt-ids", "1", "--top-p", "inf"],
    ["run", "C", "--prompt-ids", "1", "--max-new", "1000000000"],
    ["run", "C", "--prompt-ids", "1", "--max-new", "-1"],
    ["run", "C", "--prompt-ids", "1", "--prefill-chunk", "0"],
    ["run", "C", "--prompt-ids", "1", "--read-threads", "0"],
    ["run", "C", "--prompt-ids", "9223372036854775808"],
    ["run", "C", "--prompt-ids", "1", "--expert-cache", "5iB"],
    ["check", "C", "--tolerance", "nan"],
    ["check", "C", "--tolerance", "-1"],
    ["check", "C", "--prompt-len", "0"],
    ["plan", "tiny", "--ram", "5iB"],
    ["plan", "tiny", "--context", "0"],
    ["run", "C", "--prompt-ids", "1", "--max-new", "1", "--expert-cache", "mmap", "--cache-policy", "lfu"],
    ["run", "C", "--prompt-ids", "1", "--max-new", "1", "--expert-cache", "mmap", "--read-threads", "8"],
    ["run", "C", "--prompt-ids", "1", "--max-new", "1", "--expert-cache", "mmap", "--expert-io", "buffered"],
    ["plan", "C", "--context", "0", "--ram", "1G", "--disk-gbps", "1", "--mem-gbps", "1"],
    ["plan", "C", "--ram", "1G", "--disk-gbps", "1e308", "--mem-gbps", "1"],
    ["plan", "C", "--ram", "1G", "--disk-gbps", "inf", "--mem-gbps", "1"],
    ["run", "C", "--prompt-ids", "1", "--max-new", "1", "--temperature", "inf"],
    # ASCII digits only: int() reads "1_0" as 10 and full-width digits; isdigit() takes "²"
    ["run", "C", "--prompt-ids", "1,\u00b2"],
    ["run", "C", "--prompt-ids", "1_0"],
    ["run", "C", "--prompt-ids", "\uff11"],
    ["run", "C", "--prompt-ids", "1", "--seed", "1_000"],
    ["check", "C", "--prompt-len", "\uff14"],
    ["plan", "tiny", "--context", "\uff14K"],
])
def test_bad_numbers_refused_before_any_work(capsys: pytest.CaptureFixture[str], container: Path,
                                             argv: list[str]) -> None:
    argv = [str(container) if a == "C" else a for a in argv]
    one_line_error(capsys, argv)


def test_max_new_checked_against_the_context_before_allocating(capsys: pytest.CaptureFixture[str],
                                                               container: Path) -> None:
    err = one_line_error(capsys, ["run", str(container), "--prompt-ids", "1", "--max-new", str(1 << 24)])
    assert "exceeds the model's capacity" in err


@pytest.mark.parametrize(("argv", "line"), [
    (["frob"], "waste: error: argument command: invalid choice: 'frob'"),
    (["run", "x.waste", "--bogus"], "waste: error: unrecognized arguments: --bogus"),
    (["run", "x.waste", "--max-new", "x"], "waste: error: waste run: argument --max-new: 'x' is not an integer"),
])
def test_usage_errors_name_the_program_once(capsys: pytest.CaptureFixture[str], argv: list[str], line: str) -> None:
    assert one_line_error(capsys, argv).startswith(line)


def test_out_of_memory_is_one_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A shape too large for the machine's memory (NumPy's MemoryError names the allocation)."""
    def no_memory(*args: object, **kwargs: object) -> None:
        raise MemoryError("Unable to allocate 256. GiB for an array with shape (65536, 1048576) and data type float32")

    monkeypatch.setattr("waste.plan.make_plan", no_memory)
    assert one_line_error(capsys, ["plan", "tiny"]) == ("waste: error: out of memory: Unable to allocate 256. GiB for "
                                                        "an array with shape (65536, 1048576) and data type float32")


def test_a_file_given_as_a_container_is_named_as_a_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "model.waste").write_text("")
    assert one_line_error(capsys, ["info", str(tmp_path / "model.waste")]).endswith(
        "not a container directory (a file; a container is a NAME.waste directory)")


def test_an_output_directory_that_cannot_be_written_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    """Not the working directory beside it that could not be made."""
    assert one_line_error(capsys, ["synth", "tiny", "/proc/x"]) == "waste: error: /proc/x: cannot write in /proc: " \
        "No such file or directory"


def test_debug_accepted_after_the_subcommand(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["info", str(tmp_path / "none.waste"), "--debug"]) == 2
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.parametrize("special", ["/dev/zero", "fifo"])
def test_unbounded_prompt_files_refused(capsys: pytest.CaptureFixture[str], container: Path, tmp_path: Path,
                                        special: str) -> None:
    if special == "fifo":
        special = str(tmp_path / "fifo")
        os.mkfifo(special)
    err = one_line_error(capsys, ["run", str(container), "--prompt-file", special, "--max-new", "1"])
    assert "not a regular file" in err


def test_outputs_refuse_foreign_files_before_the_prompt_runs(capsys: pytest.CaptureFixture[str], container: Path,
                                                             tmp_path: Path) -> None:
    precious = tmp_path / "manifest.json"
    precious.write_text("{}")
    run = ["run", str(container), "--prompt-ids", "1,2", "--max-new", "1"]
    for flag in ("--logits-out", "--session-out", "--trace-out"):
        err = one_line_error(capsys, [*run, flag, str(precious)])
        assert "not an earlier" in err and "--force" in err
        assert "generated" not in capsys.readouterr().out
    assert precious.read_text() == "{}"
    err = one_line_error(capsys, [*run, "--logits-out", str(tmp_path / "no" / "l.npy")])
    assert "does not exist" in err
    # The user's own earlier outputs of the same kind are replaced without --force.
    logits, session = tmp_path / "l.npy", tmp_path / "s.npz"
    assert main([*run, "--logits-out", str(logits), "--session-out", str(session)]) == 0
    assert main([*run, "--logits-out", str(logits), "--session-out", str(session)]) == 0
    assert np.load(logits).shape[0] == 3
    assert main([*run, "--logits-out", str(precious), "--force"]) == 0


def test_sizes_refuse_a_unitless_ib() -> None:
    from waste.errors import WasteError
    from waste.units import parse_size

    assert parse_size("5KiB") == 5 << 10 and parse_size("5B") == 5 and parse_size("5kb") == 5 << 10
    for text in ("5iB", "5i", "KiB"):
        with pytest.raises(WasteError):
            parse_size(text)


def test_no_progress_bar_on_a_log_and_no_nan_speed(capsys: pytest.CaptureFixture[str], container: Path,
                                                   tmp_path: Path) -> None:
    """stderr that is not a terminal gets the error line alone (no progress bar's carriage
    returns), and a run that decodes nothing prints no NaN speed."""
    from safetensors.numpy import load_file, save_file

    from waste.synth import synthesize

    hf = synthesize("tiny", tmp_path / "hf", dtype="f32")
    shard = next(hf.glob("*.safetensors"))
    tensors = load_file(str(shard))
    tensors["lm_head.weight"][3, 5] = np.nan  # found while converting, the bar already running
    save_file(tensors, str(shard))
    err = one_line_error(capsys, ["convert", str(hf), str(tmp_path / "c.waste")])
    assert "lm_head" in err and "\r" not in err
    assert main(["run", str(container), "--prompt-ids", "1,2", "--max-new", "0"]) == 0
    out = capsys.readouterr().out
    assert "nan" not in out and "decode: 0 tokens" in out


def test_an_unwritable_output_directory_is_refused_before_the_prompt_runs(
        capsys: pytest.CaptureFixture[str], container: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory the run cannot create files in (here a read-only file system, as mkstemp sees it)
    is refused before the prompt runs, not after the whole run when the output is written."""
    import waste.fileio

    def read_only(*args: object, **kwargs: object) -> tuple[int, str]:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(waste.fileio.tempfile, "mkstemp", read_only)
    for flag in ("--logits-out", "--session-out", "--trace-out"):
        err = one_line_error(capsys, ["run", str(container), "--prompt-ids", "1,2", "--max-new", "1", flag,
                                      str(tmp_path / "out.bin")])
        assert f"cannot write in {tmp_path}: Read-only file system" in err
        assert "generated" not in capsys.readouterr().out


def test_demo_keeps_out_of_a_directory_it_did_not_make(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from waste.demo import DEMO_MARK, _claim_work_dir

    work = tmp_path / "mine"
    (work / "tiny.waste").mkdir(parents=True)
    (work / "tiny.waste" / "notes.txt").write_text("keep me")
    err = one_line_error(capsys, ["demo", "--work-dir", str(work)])
    assert "waste demo did not write" in err and "--force" in err
    assert (work / "tiny.waste" / "notes.txt").read_text() == "keep me" and not (work / DEMO_MARK).exists()
    (tmp_path / "file").write_text("")
    assert "not a directory" in one_line_error(capsys, ["demo", "--work-dir", str(tmp_path / "file")])
    # New, empty and the demo's own directories are taken; another only with --force.
    (tmp_path / "empty").mkdir()
    for fresh in (tmp_path / "new", tmp_path / "empty"):
        _claim_work_dir(fresh, force=False)
        _claim_work_dir(fresh, force=False)
        assert (fresh / DEMO_MARK).is_file()
    _claim_work_dir(work, force=True)
    assert (work / DEMO_MARK).is_file()


def test_a_full_device_names_the_output(capsys: pytest.CaptureFixture[str], container: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails for want of space names the output it was writing (a container's write
    carries no file name of its own), and leaves nothing behind."""
    import waste.container.writer

    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(waste.container.writer.os, "pwrite", full)
    out = tmp_path / "x.waste"
    err = one_line_error(capsys, ["synth", "tiny", str(out), "--quant", "q4", "--quiet"])
    assert err == f"waste: error: {out}: cannot write the container: No space left on device"
    assert list(tmp_path.iterdir()) == []


def test_an_interrupt_is_one_line_and_exit_130(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C: the shell's code for SIGINT (128 + 2), not a check's failure (1), and no traceback."""
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("waste.plan.make_plan", interrupted)
    assert main(["plan", "tiny"]) == 130
    assert capsys.readouterr().err == "waste: interrupted\n"
