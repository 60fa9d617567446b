"""sparrow's lean GGUF reader against the gguf package's GGUFReader, and its failure modes."""

import gguf
import numpy as np
import pytest

import reference_models as rm
import sparrow
from sparrow.errors import SparrowError
from sparrow.loaders.gguf_file import GGUFFile


def test_same_tensors_and_metadata_as_gguf_reader():
    path = rm.default_gguf_path()
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.shape == tuple(int(d) for d in b.shape) and a.tensor_type == b.tensor_type
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data), a.name
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        got = ours.meta[key]
        got = got.tolist() if isinstance(got, np.ndarray) else got
        assert got == field.contents(), key


def test_truncated_gguf_is_one_line_error(tmp_path):
    data = open(rm.default_gguf_path(), "rb").read()
    for cut in (20, 2_000_000, len(data) - 1000):  # inside the header, the vocabulary, the tensor data
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(SparrowError, match="truncated") as e:
            sparrow.load(str(p))
        assert "\n" not in str(e.value)
