"""Experiments: documented, resumable commands that produce the numbers in ``docs/results.md``.

- :mod:`distill.experiments.smollm2_opd`: SmolLM2-135M-Instruct (GGUF) distilled into a
  block-diffusion student by on-policy distillation, on real prompts, on the CPU.
"""
