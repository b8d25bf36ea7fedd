"""The SmolLM2 OPD experiment: its pieces, and the whole run on a tiny GGUF file."""

import dataclasses
import json

import numpy as np
import pytest

from distill.experiments import smollm2_opd as experiment
from distill.models import gguf
from tests.models.test_gguf import tiny_hf_weights, write_tiny_gguf


def test_verify_reads_the_last_word():
    assert experiment.verify("The capital of France is Paris.", "paris")
    assert experiment.verify("2 + 3 = 5", "5")
    assert not experiment.verify("Paris, not Rome", "Paris")
    assert not experiment.verify("", "Paris")
    assert not experiment.verify("4 + 4 = 10", "8")


def test_speeches_split_by_play_and_tasks_by_item():
    train, held_out = experiment.speeches("train"), experiment.speeches("eval")
    assert len(train) > 10_000 and len(held_out) > 1_000
    assert not set(train) & set(held_out)
    assert all(len(speech) >= 2 and all(speech) for speech in held_out[:100])
    for task in experiment.CANDIDATE_TASKS.values():
        assert len({subject for subject, _ in task.items}) == len(task.items)
        split = task.split("eval"), task.split("train")
        assert len(split[0]) + len(split[1]) == len(task.items) and split[0] and split[1]
    with pytest.raises(experiment.ExperimentError, match="^`split` must be"):
        experiment.speeches("test")


def test_config_is_validated():
    with pytest.raises(experiment.ExperimentError, match=r"^`ks` must be positive ints dividing"):
        experiment.ExperimentConfig(ks=(1, 3))
    with pytest.raises(experiment.ExperimentError, match=r"^`train_k` must be one of"):
        experiment.ExperimentConfig(train_k=16)
    with pytest.raises(experiment.ExperimentError, match=r"^`passage_tokens` must be"):
        experiment.ExperimentConfig(passage_tokens=(40, 80))
    with pytest.raises(experiment.ExperimentError, match=r"^`block_size` must be >= 2"):
        experiment.ExperimentConfig(block_size=1)
    assert experiment.ExperimentConfig().schedule_steps(4) == 4


@pytest.fixture(scope="module")
def smollm2_source():
    path = gguf.smollm2_path()
    tasks = tuple(experiment.CANDIDATE_TASKS.values())
    config = experiment.ExperimentConfig()
    return experiment.PromptSource(gguf.load_tokenizer(path), gguf.chat_format(path), tasks, config)


def test_prompts_are_deterministic_real_and_fit(smollm2_source):
    source = smollm2_source
    low, high = source.config.passage_tokens
    prompts = [source.train_prompt(position) for position in range(40)]
    assert prompts == [source.train_prompt(position) for position in range(40)]
    kinds = {prompt.kind for prompt in prompts}
    assert kinds == {"passage", "instruction"}
    for prompt in prompts + source.eval_passages() + source.eval_instructions():
        assert len(prompt.ids) <= source.config.max_prompt_tokens
        if prompt.kind == "passage":
            assert low <= len(prompt.ids) <= high and prompt.text.endswith("\n")
            assert source.tokenizer.decode(list(prompt.ids)) == prompt.text
        else:
            assert prompt.ids[:1] == (1,)  # <|im_start|>: ChatML, SmolLM2's system turn first
            text = source.tokenizer.decode(list(prompt.ids), skip_special=False)
            assert text.endswith(f"user\n{prompt.text}<|im_end|>\n<|im_start|>assistant\n")
    sampled = source.sampled_instructions()
    assert len(sampled) == source.config.eval_sampled_instructions
    assert [p.task for p in sampled[:5]] == list(experiment.CANDIDATE_TASKS)


TINY = dict(
    block_size=4,
    completion_length=8,
    ks=(1, 4),
    train_k=4,
    steps=2,
    prompts_per_step=2,
    checkpoint_every=1,
    eval_every=1,
    passage_tokens=(12, 40),
    max_prompt_tokens=192,
    eval_passages=2,
    eval_sampled_instructions=2,
    samples=2,
    min_teacher_accuracy=0.0,  # a random teacher is good at nothing
)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    template = gguf._open(gguf.smollm2_path()).metadata["tokenizer.chat_template"]
    path = write_tiny_gguf(
        tmp_path_factory.mktemp("gguf") / "tiny.gguf",
        tiny_hf_weights(),
        meta={"tokenizer.chat_template": template, "llama.context_length": 512},
    )
    return experiment.ExperimentConfig(gguf=str(path), **TINY)


@pytest.mark.slow
def test_the_whole_experiment_runs_and_resumes_on_a_tiny_gguf(tmp_path, tiny_config):
    config = tiny_config
    run_dir = tmp_path / "run"
    logs: list[str] = []
    results = experiment.run(config, run_dir, progress=False, log=logs.append)
    assert set(results["before"]) == set(results["after"]) == {"1", "4"}
    assert results["tasks"]["kept"] == list(experiment.CANDIDATE_TASKS)
    for entry in [results["teacher"], *results["before"].values(), *results["after"].values()]:
        for key in ("passage_logp", "instruction_logp", "exact_match", "distinct"):
            assert np.isfinite(entry[key]), key
        assert entry["passage_logp"] < 0 and 0 <= entry["distinct"] <= 1
    assert results["teacher"]["tokens_per_forward"] == 1.0
    # k = 1: one token per forward; k = 4 = the block: anchor + one step per block.
    assert results["before"]["1"]["tokens_per_forward"] == pytest.approx(1.0)
    assert 1.0 < results["before"]["4"]["tokens_per_forward"] <= 2.0
    assert all(results["before"][k]["tokens_per_second"] > 0 for k in ("1", "4"))
    assert sorted(map(int, results["opd"]["steps"])) == [0, 1]
    assert [at for at, _ in results["opd"]["evaluations"]] == [0, 1, 2]
    report = (run_dir / "report.md").read_text()
    assert report.count("| student after OPD |") == 2 and "| capital |" in report
    assert (run_dir / "opd" / "contract.json").is_file()
    contract = json.loads((run_dir / "opd" / "contract.json").read_text())
    assert contract["prompts"]["tasks"][0]["name"] == "capital"

    # A rerun reuses every phase and gives the same results.
    again = experiment.run(config, run_dir, progress=False, log=logs.append)
    assert again == results
    assert sum("reusing" in line for line in logs) >= 2 + 2 * 2

    # The evaluation after OPD is redone from the checkpoint when its file is lost.
    (run_dir / "eval" / "after-k4.json").unlink()
    redone = experiment.run(config, run_dir, progress=False, log=logs.append)
    assert redone["after"]["4"] == results["after"]["4"]

    # Another configuration is refused in this run directory, naming the fields.
    other = dataclasses.replace(config, steps=3, seed=1)
    with pytest.raises(experiment.ExperimentError, match=r"^`config` must equal the run's") as e:
        experiment.run(other, run_dir, progress=False, log=logs.append)
    assert "seed: 0 -> 1" in str(e.value) and "steps: 2 -> 3" in str(e.value)


class Interrupted(Exception):
    pass


@pytest.mark.slow
def test_an_interrupted_opd_phase_resumes_to_the_same_student(tmp_path, tiny_config, monkeypatch):
    from distill.opd.learner import OpdLearner

    config = dataclasses.replace(tiny_config, steps=3, ks=(4,))
    whole = experiment.run(config, tmp_path / "whole", progress=False, log=lambda _: None)

    train = OpdLearner.train

    def interrupted(self, *args, **kwargs):
        if self.step == 1:  # step 0 is trained and checkpointed (checkpoint_every=1)
            raise Interrupted
        return train(self, *args, **kwargs)

    monkeypatch.setattr(OpdLearner, "train", interrupted)
    with pytest.raises(Interrupted):
        experiment.run(config, tmp_path / "resumed", progress=False, log=lambda _: None)
    assert sorted(json.loads((tmp_path / "resumed" / "opd_steps.json").read_text())["steps"]) == [
        "0"
    ]
    monkeypatch.setattr(OpdLearner, "train", train)
    logs: list[str] = []
    resumed = experiment.run(config, tmp_path / "resumed", progress=False, log=logs.append)
    assert any("resumed" in line and "at step 1" in line for line in logs)
    assert resumed["after"] == whole["after"]  # the same student, evaluated the same way
    for step in ("0", "1", "2"):
        strip = lambda metrics: {k: v for k, v in metrics.items() if k != "seconds"}  # noqa: E731
        assert strip(resumed["opd"]["steps"][step]) == strip(whole["opd"]["steps"][step])
