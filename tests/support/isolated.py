"""Run test files each in a fresh pytest process, a few at a time.

    python -m tests.support.isolated [--jobs N] [--file-timeout S] PATH [PATH ...]

Each test file under the PATHs (``test_*.py``, or the files named) gets its own pytest
process: the end-to-end modules start and stop embedded Ray clusters, SIGKILL actors and
compile many programs, and a long-lived xdist worker that had run several of them crashed
now and then with SIGSEGV in libgcc's unwinder at the start of the next module (then
xdist's worker replacement stalled the whole run). A process per file keeps every module's
start clean and a crash confined to its file, named in the summary. Files start biggest
first; the output of a file is printed whole when it ends; the exit status is 0 only when
every file's pytest exited 0.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path


def find_test_files(paths: list[str]) -> list[Path]:
    """The test files under ``paths`` (directories searched recursively), sorted, unique."""
    files: list[Path] = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            files.extend(sorted(path.rglob("test_*.py")))
        elif path.is_file():
            files.append(path)
        else:
            raise SystemExit(f"`PATH` must be a test file or directory; received {name!r}")
    return list(dict.fromkeys(files))


def run_file(path: Path, pytest_args: list[str], timeout_s: float) -> tuple[int, str, float]:
    """Run pytest on one file: (exit status, combined output, seconds)."""
    start = time.monotonic()
    command = [sys.executable, "-m", "pytest", *pytest_args, str(path)]
    try:
        done = subprocess.run(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            timeout=timeout_s,
        )
        status, output = done.returncode, done.stdout
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout or ""
        if isinstance(output, bytes):
            output = output.decode(errors="replace")
        status = 124
        output += f"\n{path}: pytest did not finish within --file-timeout {timeout_s:.0f} s\n"
    return status, output, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", metavar="PATH")
    parser.add_argument("--jobs", type=int, default=2, help="files run at once (default 2)")
    parser.add_argument(
        "--file-timeout",
        type=float,
        default=2400.0,
        help="seconds one file's pytest may take in all (default 2400)",
    )
    parser.add_argument(
        "--pytest-arg",
        action="append",
        default=[],
        help="an argument passed on to each pytest (repeatable)",
    )
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"`--jobs` must be >= 1; received {args.jobs}")
    if args.file_timeout <= 0:
        parser.error(f"`--file-timeout` must be > 0; received {args.file_timeout}")
    files = find_test_files(args.paths)
    if not files:
        print(f"no test files under {' '.join(args.paths)}", file=sys.stderr)
        return 5
    # Biggest files first (size stands in for run time: the fault-injection module is both),
    # so the long ones do not start last and leave one slot idle at the end.
    files.sort(key=lambda path: path.stat().st_size, reverse=True)
    failed: list[str] = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        runs = {pool.submit(run_file, f, args.pytest_arg, args.file_timeout): f for f in files}
        for future in as_completed(runs):
            status, output, seconds = future.result()
            path = runs[future]
            print(f"== {path} (exit {status}, {seconds:.0f} s)", flush=True)
            print(output.rstrip(), flush=True)
            if status != 0:
                failed.append(f"{path} (exit {status})")
    print(f"== {len(files) - len(failed)} of {len(files)} files passed", flush=True)
    for name in failed:
        print(f"FAILED FILE {name}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
