"""A tensorflow-datasets builder for the QA schema, built from local files (no download, no TensorFlow).

Written in the array_record format and read back through `builder.as_data_source()`, which needs
`tensorflow-datasets` (+ its `array_record` dependency) but not the `tensorflow` package. The trainer
uses the plain reader (`read_qa_file`); this is for pipelines that consume tfds datasets (grain, t5x
style). Import cost: `pip install tensorflow-datasets` adds ~12 small packages (array_record,
pyarrow, dm-tree, promise, tensorflow-metadata, ...), no TensorFlow.

    builder = prepare_tfds({"train": ["nq_train.jsonl"], "test": ["nq_test_1k.jsonl"]}, "/tmp/tfds")
    examples = read_tfds(builder, "test")          # list[QAExample], file order kept

The builder's config name is a hash of the input files (paths, sizes, mtimes) and the reading options,
so changed inputs get a new dataset directory instead of silently reusing a stale one.
"""
from __future__ import annotations

import hashlib
import json
import os

from rexrag_jax.data.readers import read_qa_file
from rexrag_jax.data.schema import QAExample

_BUILDER = None


def _tfds():
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise ImportError("rexrag_jax.data.tfds_qa needs tensorflow-datasets (pip install tensorflow-datasets; "
                          "TensorFlow itself is not needed). The plain reader rexrag_jax.data.read_qa_file "
                          f"has no such dependency. ({e})") from None
    return tfds


def builder_class():
    """The `SearchR1Qa` GeneratorBasedBuilder class (created on first use, not registered globally)."""
    global _BUILDER
    if _BUILDER is not None:
        return _BUILDER
    tfds = _tfds()

    class SearchR1Qa(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        """QA examples in Search-R1 form: id, question, golden_answers, data_source."""

        VERSION = tfds.core.Version("1.0.0")
        RELEASE_NOTES = {"1.0.0": "QAExample schema from local jsonl/json/csv/parquet files."}

        # tfds looks for checksums/metadata beside the builder's source file via importlib_resources,
        # an undeclared dependency; a locally-built dataset has neither, so there is no code path.
        @tfds.core.utils.classproperty
        @classmethod
        def code_path(cls):
            return None

        def __init__(self, *, split_files: dict, data_source=None, skip_bad_rows=False, **kwargs):
            self._split_files = {s: [os.fspath(f) for f in fs] for s, fs in split_files.items()}
            self._data_source, self._skip_bad_rows = data_source, skip_bad_rows
            name = _fingerprint(self._split_files, data_source, skip_bad_rows)
            super().__init__(config=tfds.core.BuilderConfig(name=name), **kwargs)

        def _info(self):
            return self.dataset_info_from_configs(
                features=tfds.features.FeaturesDict({
                    "id": tfds.features.Text(),
                    "question": tfds.features.Text(),
                    "golden_answers": tfds.features.Sequence(tfds.features.Text()),
                    "data_source": tfds.features.Text(),
                }),
                disable_shuffling=True,  # keep file order, same as the plain reader
            )

        def _split_generators(self, dl_manager):
            return {split: self._generate_examples(files) for split, files in self._split_files.items()}

        def _generate_examples(self, files):
            for k, path in enumerate(files):
                for i, ex in enumerate(read_qa_file(path, self._data_source, skip_bad_rows=self._skip_bad_rows)):
                    yield f"{k:04d}-{i:09d}", ex.to_dict()

    _BUILDER = SearchR1Qa
    return _BUILDER


def _fingerprint(split_files: dict, data_source, skip_bad_rows) -> str:
    items = []
    for split in sorted(split_files):
        for f in split_files[split]:
            st = os.stat(f)
            items.append([split, os.path.abspath(f), st.st_size, st.st_mtime_ns])
    blob = json.dumps([items, data_source, skip_bad_rows]).encode()
    return "files_" + hashlib.sha256(blob).hexdigest()[:16]


def prepare_tfds(split_files: dict, data_dir, *, data_source: str | None = None, skip_bad_rows: bool = False,
                 file_format: str = "array_record"):
    """Build (or reuse) the dataset under data_dir and return the prepared builder."""
    for split, files in split_files.items():
        for f in files:
            if not os.path.isfile(f):
                raise FileNotFoundError(f"split {split!r}: QA file not found: {f}")
    builder = builder_class()(split_files=split_files, data_source=data_source, skip_bad_rows=skip_bad_rows,
                              data_dir=os.fspath(data_dir), file_format=file_format)
    builder.download_and_prepare()
    return builder


def _text(v) -> str:
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def read_tfds(builder, split: str) -> list[QAExample]:
    """All examples of `split`, decoded from the array_record data source (random access, no TensorFlow)."""
    source = builder.as_data_source()[split]
    return [QAExample(id=_text(r["id"]), question=_text(r["question"]),
                      golden_answers=[_text(a) for a in r["golden_answers"]], data_source=_text(r["data_source"]))
            for r in (source[i] for i in range(len(source)))]
