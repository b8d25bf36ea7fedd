"""The `distill` command: configuration errors are one line per field, exit status 2;
`score` prints a per-token table (or JSON); `serve teacher` warms up its compiled shapes."""

import argparse
import json
import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from distill.models.hf import load_teacher
from distill.teacher import InProcessTeacher
from distill.teacher_contract import ScoredSequence, ScoreShapes, TeacherInfo
from services import cli
from tests.services.teacher.test_teacher_server import tiny_llama_checkpoint

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 120  # bound on any single wait; only reached when something hangs


def test_unknown_override_is_reported_by_field_with_exit_status_two(tmp_path, capsys):
    status = cli.main(
        [
            "train-teacher",
            "deploy/configs/tiny.yaml",
            "--run-dir",
            str(tmp_path),
            "--set",
            "teacher.n_layers=-1",
        ]
    )
    assert status == 2
    assert "`teacher.n_layers` must be greater than 0" in capsys.readouterr().err


def test_a_guard_trip_is_reported_by_message_with_exit_status_one(tmp_path, capsys, monkeypatch):
    from distill.opd.guard import PolicyRegression

    def tripped(args):
        raise PolicyRegression("`metrics.teacher_logp` must stay within ...")

    monkeypatch.setattr(cli, "_opd", tripped)
    args = ["opd", "deploy/configs/tiny.yaml", "--run-dir", str(tmp_path), "--student-run", "x"]
    assert cli.main(args) == 1
    assert "distill opd: `metrics.teacher_logp` must stay within" in capsys.readouterr().err


def test_warmup_from_teacher_requires_a_teacher_run(tmp_path, capsys):
    status = cli.main(["warmup-student", "deploy/configs/tiny.yaml", "--run-dir", str(tmp_path)])
    assert status == 2
    assert "`--teacher-run`" in capsys.readouterr().err


def test_short_teacher_run_through_the_cli_writes_checkpoints_and_a_report(tmp_path):
    overrides = [
        "teacher.d_model=32",
        "teacher.d_ff=64",
        "student.d_model=32",
        "student.d_ff=64",
        "teacher_training.steps=2",
        "teacher_training.optimizer.warmup_steps=1",
        "teacher_training.eval_examples=4",
        "data.batch_size=4",
    ]
    args = ["train-teacher", "deploy/configs/tiny.yaml", "--run-dir", str(tmp_path), "--quiet"]
    for override in overrides:
        args += ["--set", override]
    assert cli.main(args) == 0
    assert (tmp_path / "contract.json").exists() and (tmp_path / "eval.json").exists()
    assert (tmp_path / "checkpoints" / "2").is_dir()


# ---- `distill score`: the per-token table and --json ----------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A random 2-layer Llama checkpoint, 32 ids (w0..w27 plus <unk> <s> </s> <pad>)."""
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("llama"))


def _reference(checkpoint, text: str):
    """The ids of ``text`` (BOS first) and the teacher's full sorted distribution per
    position, straight from :class:`InProcessTeacher`."""
    model, loaded = load_teacher(checkpoint)
    teacher = InProcessTeacher(model, loaded.tokenizer)
    ids = [loaded.tokenizer.special.bos_id, *loaded.tokenizer.encode(text)]
    return ids, teacher.score([ids], top_k=model.config.vocab_size)[0]


def test_score_prints_a_table_with_the_rank_of_each_token(llama, capsys):
    text = "w3 w1 w5 w7"
    assert cli.main(["score", "--hf-checkpoint", str(llama), text, "--top-k", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    ids, scored = _reference(llama, text)
    assert lines[0].split() == ["position", "token", "id", "log-prob", "rank"]
    assert len(lines) == 1 + 4 + 1
    for position, line in enumerate(lines[1:5]):
        fields = line.split()
        token = ids[position + 1]
        rank = 1 + int(np.flatnonzero(scored.top_ids[position] == token)[0])
        assert fields[:5] == [
            str(position + 1),
            repr(f"w{token - 4}"),
            str(token),
            f"{scored.log_probs[position]:.4f}",
            str(rank),
        ]
        # Rank r: exactly r - 1 ids are more likely than the actual token.
        assert np.sum(scored.top_log_probs[position] > scored.log_probs[position] + 1e-6) < rank
        best = scored.top_ids[position, 0]
        assert fields[5] == "top:" and fields[6].startswith(f"{repr(loaded_word(best))}:")
        assert line.count(":") == 3  # "top:" and two entries
    total = float(np.sum(scored.log_probs, dtype=np.float64))
    assert lines[5] == (
        f"total {total:.4f} nats over 4 tokens (mean {total / 4:.4f} nats/token, "
        f"perplexity {math.exp(-total / 4):.2f})"
    )


def loaded_word(token: int) -> str:
    return ["<unk>", "<s>", "</s>", "<pad>", *(f"w{i}" for i in range(28))][int(token)]


def test_score_json_is_one_object_with_ids_log_probs_ranks_and_the_top_k(llama, capsys):
    text = "w3 w1 w5 w7"
    assert cli.main(["score", "--hf-checkpoint", str(llama), text, "--top-k", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    ids, scored = _reference(llama, text)
    assert report["input_ids"] == ids and report["ids"] == ids[1:]
    assert report["tokens"] == ["w3", "w1", "w5", "w7"]
    np.testing.assert_array_equal(np.float32(report["log_probs"]), scored.log_probs)
    assert report["ranks"] == [
        1 + int(np.flatnonzero(scored.top_ids[i] == token)[0]) for i, token in enumerate(ids[1:])
    ]
    assert report["rank_window"] == report["vocab_size"] == 32 and report["num_tokens"] == 4
    assert report["total_log_prob"] == pytest.approx(float(np.sum(scored.log_probs)), abs=1e-5)
    assert report["mean_log_prob"] == pytest.approx(report["total_log_prob"] / 4)
    assert report["perplexity"] == pytest.approx(math.exp(-report["mean_log_prob"]))
    assert [len(entries) for entries in report["top_k"]] == [3] * 4
    for position, entries in enumerate(report["top_k"]):
        assert [e["id"] for e in entries] == scored.top_ids[position, :3].tolist()
        assert [e["token"] for e in entries] == [loaded_word(e["id"]) for e in entries]
        np.testing.assert_array_equal(
            np.float32([e["log_prob"] for e in entries]), scored.top_log_probs[position, :3]
        )
    # Without --top-k: no top-k entries, the ranks are still there.
    assert cli.main(["score", "--hf-checkpoint", str(llama), text, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert "top_k" not in plain and plain["ranks"] == report["ranks"]


def test_score_refuses_a_top_k_beyond_the_vocabulary(llama, capsys):
    assert cli.main(["score", "--hf-checkpoint", str(llama), "w3", "--top-k", "33"]) == 2
    assert "`--top-k` must be in [1, 32] (the vocabulary); received 33" in capsys.readouterr().err


def test_ranks_outside_the_window_are_shown_as_beyond_it():
    scored = ScoredSequence(
        log_probs=np.float32([-0.1, -3.0]),
        top_ids=np.int32([[5, 6], [6, 5]]),
        top_log_probs=np.float32([[-0.1, -2.0], [-0.5, -1.0]]),
    )
    assert cli._ranks([1, 5, 7], scored, window=2) == [1, None]
    assert cli._ranks([1, 6, 5], scored, window=1) == [None, None]
    assert cli._ranks([1, 6, 5], scored, window=2) == [2, 2]


def test_report_over_a_window_marks_ranks_beyond_it(capsys):
    scored = ScoredSequence(
        log_probs=np.float32([-0.1, -3.0]),
        top_ids=np.int32([[5, 6], [6, 5]]),
        top_log_probs=np.float32([[-0.1, -2.0], [-0.5, -1.0]]),
    )
    info = TeacherInfo(
        vocab_size=100, pad_id=0, bos_id=1, mask_id=2, stop_ids=(3,), tokenizer_hash="t",
        model_hash="m", max_length=8,
    )  # fmt: skip
    args = cli.build_parser().parse_args(["score", "--ids", "1 5 7", "--server", "x:1"])
    cli._report_scores(args, [1, 5, 7], scored, None, info, window=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["1", "5", "5", "-0.1000", "1"]
    assert lines[2].split() == ["2", "7", "7", "-3.0000", ">2"]
    assert lines[3].endswith("; ranks beyond 2 shown as >2)") and "over 2 tokens" in lines[3]
    args.json = True
    cli._report_scores(args, [1, 5, 7], scored, None, info, window=2)
    report = json.loads(capsys.readouterr().out)
    assert report["ranks"] == [1, None] and report["rank_window"] == 2
    assert report["tokens"] is None and "top_k" not in report


# ---- `distill serve teacher`: compiled shapes, warm-up, metrics -------------------------------


def _parse_serve(*extra: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["serve", "teacher", "--hf-checkpoint", "x", *extra])


def test_serve_teacher_picks_the_default_shapes_when_their_largest_call_fits_a_batch():
    shapes, why = cli._score_shapes(_parse_serve(), 64)  # 32 rows x 64 <= 16384 tokens
    assert shapes == ScoreShapes.default(64, 32) and why.startswith("auto")
    shapes, why = cli._score_shapes(_parse_serve(), 8192)  # 32 x 8192 > 16384
    assert shapes is None
    assert why == "auto: max_batch_sequences 32 x max_length 8192 > max_batch_tokens 16384"
    forced, _ = cli._score_shapes(_parse_serve("--shapes", "default"), 8192)
    assert forced == ScoreShapes.default(8192, 32)
    assert cli._score_shapes(_parse_serve("--shapes", "none"), 64) == (None, "--shapes none")
    small, _ = cli._score_shapes(_parse_serve("--max-batch-sequences", "2"), 16)
    assert small == ScoreShapes(rows=(1, 2), lengths=(16,), top_ks=(8, 64), candidates=(8, 64))


def test_serve_teacher_refuses_bad_max_length_and_metrics_flags(llama, capsys):
    assert cli.main(["serve", "teacher", "--hf-checkpoint", str(llama), "--max-length", "1"]) == 2
    assert "`--max-length` must be >= 2; received 1" in capsys.readouterr().err
    public = ["--metrics-address", "0.0.0.0:0"]
    assert cli.main(["serve", "teacher", "--hf-checkpoint", str(llama), *public]) == 2
    assert "`metrics_address` must be loopback unless" in capsys.readouterr().err
    shared = ["--shapes", "none", "--warm-shared-prompts"]
    assert cli.main(["serve", "teacher", "--hf-checkpoint", str(llama), *shared]) == 2
    assert "`--warm-shared-prompts` must come with compiled shapes" in capsys.readouterr().err
    run = ["deploy/configs/tiny.yaml", "--teacher-run", "r", "--max-length", "8"]
    assert cli.main(["serve", "teacher", *run]) == 2
    assert "`--max-length` must come with --hf-checkpoint or --gguf" in capsys.readouterr().err


def test_serve_teacher_warms_up_its_shapes_prints_them_and_serves_metrics(llama, capsys, tmp_path):
    # 16 ids, batches of at most 2: ScoreShapes.default(16, 2), 2 rows x 1 length x (forward
    # + 2 top-k + 2 candidate heads) = 10 shapes.
    env = os.environ | {"JAX_PLATFORMS": "cpu", "JAX_DEFAULT_MATMUL_PRECISION": "float32"}
    env.pop("DISTILL_TOKEN", None)
    command = [sys.executable, "-m", "services.cli", "serve", "teacher"]
    command += ["--hf-checkpoint", str(llama), "--max-length", "16"]
    command += ["--max-batch-sequences", "2", "--metrics-address", "127.0.0.1:0"]
    command += ["--compile-cache", str(tmp_path / "jax")]
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in process.stdout], daemon=True).start()
    try:
        seen = []
        while not (seen and seen[-1].startswith("serving teacher on ")):
            try:
                seen.append(lines.get(timeout=WAIT_S))
            except queue.Empty:
                pytest.fail(f"no 'serving teacher on' line; got {seen}")
        teacher_line = next(line for line in seen if line.startswith("teacher: "))
        assert "max_length 16," in teacher_line
        assert re.search(
            r"; warm-up compiled \d+ shapes in [\d.]+ s \(rows 1\.\.2 x lengths 16; top-k 8, "
            r"64; candidates 8, 64\); compile cache .*/jax$",
            teacher_line.strip(),
        ), teacher_line
        # A fresh process: its jit caches start empty, so the warm-up compiled all 10.
        assert "compiled 10 shapes" in teacher_line
        metrics = next(line for line in seen if line.startswith("metrics on ")).split()[-1]
        address = seen[-1].split()[-1]

        text = "w3 w1 w5 w7"
        served = ["score", "--server", address, "--hf-checkpoint", str(llama), text, "--json"]
        assert cli.main([*served, "--top-k", "2"]) == 0
        through_server = json.loads(capsys.readouterr().out)
        local = ["score", "--hf-checkpoint", str(llama), text, "--top-k", "2", "--json"]
        assert cli.main(local) == 0
        local = json.loads(capsys.readouterr().out)
        assert through_server == local  # the server's top-k reaches the whole vocabulary
        body = urllib.request.urlopen(metrics, timeout=WAIT_S).read().decode()
        assert "distill_teacher_compiles 10.0" in body  # nothing compiled while serving

        process.send_signal(signal.SIGTERM)
        assert process.wait(WAIT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(WAIT_S)
