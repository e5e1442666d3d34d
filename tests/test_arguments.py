"""Every public constructor and writer checks its arguments: a wrong kind of value is a TypeError, a value out of
range a ValueError, and the message names the argument. One table, one row per (callable, argument, bad value);
a completeness test keeps every public parameter in the table, so a new argument cannot ship unchecked."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

import pageset
from benchmarks.multimodal import GPT2
from pageset import (
    JSON,
    CenterCrop,
    Float,
    FloatDecoder,
    Int,
    IntDecoder,
    Loader,
    NDArray,
    Normalize,
    RandomResizedCrop,
    RGBImage,
    ToDevice,
    Tokens,
    TokenWindows,
    ToTorchImage,
    write_dataset,
    write_tokens,
)

T, V = TypeError, ValueError
GPT2_FILES = tuple(str(GPT2 / f) for f in ("encoder.json", "vocab.bpe"))  # a real BPE for ChatTokenizer's rows

# (callable name, argument, bad value, exception, regex the message must match)
OPS = [
    ("RandomResizedCrop", "size", "22", T, r"RandomResizedCrop\.size must be an int or a \(height, width\)"),
    ("RandomResizedCrop", "size", "224", T, r"RandomResizedCrop\.size .*got '224' \(str\)"),
    ("RandomResizedCrop", "size", 224.0, T, r"RandomResizedCrop\.size .*224\.0 \(float\)"),
    ("RandomResizedCrop", "size", (224,), T, r"RandomResizedCrop\.size"),
    ("RandomResizedCrop", "size", (224, 224, 3), T, r"RandomResizedCrop\.size"),
    ("RandomResizedCrop", "size", 0, V, r"RandomResizedCrop\.size must be an int in \[1, 65535\], got 0"),
    ("RandomResizedCrop", "size", 100000, V, r"RandomResizedCrop\.size must be an int in \[1, 65535\], got 100000"),
    ("RandomResizedCrop", "size", (224, 70000), V, r"RandomResizedCrop\.size\[1\] \(width\) must be an int in "
                                                   r"\[1, 65535\], got 70000"),
    ("RandomResizedCrop", "size", (32, "32"), T, r"RandomResizedCrop\.size\[1\] \(width\)"),
    ("RandomResizedCrop", "size", True, T, r"RandomResizedCrop\.size"),
    ("RandomResizedCrop", "scale", (0.5, 0.1), V, r"RandomResizedCrop\.scale .*lo <= hi"),
    ("RandomResizedCrop", "scale", (0.0, 1.0), V, r"RandomResizedCrop\.scale\[0\]"),
    ("RandomResizedCrop", "scale", (0.1, 2.0), V, r"RandomResizedCrop\.scale .*<= 1"),
    ("RandomResizedCrop", "scale", "0.5", T, r"RandomResizedCrop\.scale must be a sequence of 2 numbers"),
    ("RandomResizedCrop", "ratio", (4 / 3, 3 / 4), V, r"RandomResizedCrop\.ratio .*lo <= hi"),
    ("RandomResizedCrop", "ratio", 1.0, T, r"RandomResizedCrop\.ratio"),
    ("CenterCrop", "size", "22", T, r"CenterCrop\.size"),
    ("CenterCrop", "size", -1, V, r"CenterCrop\.size"),
    ("CenterCrop", "size", 65536, V, r"CenterCrop\.size must be an int in \[1, 65535\]"),
    ("CenterCrop", "ratio", 0, V, r"CenterCrop\.ratio must be a finite number in \(0, 1\]"),
    ("CenterCrop", "ratio", 1.5, V, r"CenterCrop\.ratio"),
    ("CenterCrop", "ratio", "0.875", T, r"CenterCrop\.ratio must be a number"),
    ("RandomResizedCrop", "resize_mode", "bilinear", V, r"RandomResizedCrop\.resize_mode must be one of \('exact', 'fast'\)"),
    ("RandomResizedCrop", "resize_mode", True, V, r"RandomResizedCrop\.resize_mode must be one of"),
    ("CenterCrop", "resize_mode", "Fast", V, r"CenterCrop\.resize_mode must be one of \('exact', 'fast'\), got 'Fast'"),
    ("RandomHorizontalFlip", "p", 1.5, V, r"RandomHorizontalFlip\.p .*\[0, 1\]"),
    ("RandomHorizontalFlip", "p", "0.5", T, r"RandomHorizontalFlip\.p must be a number"),
    ("RandomHorizontalFlip", "p", float("nan"), V, r"RandomHorizontalFlip\.p must be a finite number"),
    ("Normalize", "mean", (0.5, 0.5), T, r"Normalize\.mean must be a sequence of 3 numbers"),
    ("Normalize", "mean", "abc", T, r"Normalize\.mean"),
    ("Normalize", "std", (0.2, 0.0, 0.2), V, r"Normalize\.std\[1\] must be a finite number > 0"),
    ("Normalize", "dtype", "float64", V, r"Normalize\.dtype must be one of"),
    ("Normalize", "dtype", torch.int8, V, r"Normalize\.dtype must be one of"),
    ("ToTorchImage", "channels_last", "yes", T, r"ToTorchImage\.channels_last must be True or False"),
    ("ToTorchImage", "channels_last", 1, T, r"ToTorchImage\.channels_last"),
    ("IntDecoder", "dtype", "int128", V, r"IntDecoder\.dtype must be one of"),
    ("IntDecoder", "dtype", 64, V, r"IntDecoder\.dtype"),
    ("FloatDecoder", "dtype", "float8", V, r"FloatDecoder\.dtype must be one of"),
    ("TokenWindows", "seq_len", "2048", T, r"TokenWindows\.seq_len must be an int >= 1, got '2048'"),
    ("TokenWindows", "seq_len", 2048.0, T, r"TokenWindows\.seq_len"),
    ("TokenWindows", "seq_len", 0, V, r"TokenWindows\.seq_len must be an int >= 1, got 0"),
    ("TokenWindows", "document_outputs", "True", T, r"TokenWindows\.document_outputs must be True or False"),
    ("TokenWindows", "input_dtype", "int16", V, r"TokenWindows\.input_dtype must be one of \('int64', 'int32'\)"),
    ("TokenWindows", "packing", "bfd", V, r"TokenWindows\.packing must be one of \('best_fit',\)"),
    ("TokenWindows", "pack_pages", 0, V, r"TokenWindows\.pack_pages must be an int >= 1"),
    ("TokenWindows", "pack_pages", 1.5, T, r"TokenWindows\.pack_pages"),
    ("TokenWindows", "split_documents", "no", T, r"TokenWindows\.split_documents must be True or False"),
    ("PadTokens", "max_length", 0, V, r"PadTokens\.max_length must be an int in \[1, 16777216\], got 0"),
    ("PadTokens", "max_length", 77.0, T, r"PadTokens\.max_length must be an int"),
    ("PadTokens", "pad_id", -1, V, r"PadTokens\.pad_id must be an int in \[0, 4294967295\], got -1"),
    ("PadTokens", "pad_id", "0", T, r"PadTokens\.pad_id must be an int"),
    ("PadTokens", "truncation", "yes", T, r"PadTokens\.truncation must be True or False"),
    ("PadTokens", "keep_last_token", 1, T, r"PadTokens\.keep_last_token must be True or False"),
    ("PadTokens", "packing", "first_fit", V, r"PadTokens\.packing must be one of \('best_fit',\)"),
    ("PadTokens", "pack_pages", 0, V, r"PadTokens\.pack_pages must be an int >= 1"),
    ("ExpandImageTokens", "image_token_id", -1, V, r"ExpandImageTokens\.image_token_id must be an int in \[0, "),
    ("ExpandImageTokens", "tokens_per_image", 0, V, r"ExpandImageTokens\.tokens_per_image must be an int in \[1, "),
    ("ExpandImageTokens", "tokens_per_image", 576.0, T, r"ExpandImageTokens\.tokens_per_image must be an int"),
    ("ExpandImageTokens", "images", 3, T, r"ExpandImageTokens\.images is the name of an RGBImages field"),
    ("SmartResize", "min_pixels", 0, V, r"SmartResize\.min_pixels must be an int in \[1, "),
    ("SmartResize", "min_pixels", 3136.0, T, r"SmartResize\.min_pixels must be an int"),
    ("SmartResize", "max_pixels", 100, V, r"SmartResize\.max_pixels must be an int in \[3136, "),  # < min_pixels
    ("SmartResize", "max_pixels", "1e6", T, r"SmartResize\.max_pixels must be an int"),
    ("SmartResize", "patch_size", 0, V, r"SmartResize\.patch_size must be an int in \[1, 1024\]"),
    ("SmartResize", "merge_size", 2.0, T, r"SmartResize\.merge_size must be an int"),
    ("SmartResize", "temporal_patch_size", -2, V, r"SmartResize\.temporal_patch_size must be an int in \[1, "),
    ("SmartResize", "max_pixels_per_row", 100, V, r"SmartResize\.max_pixels_per_row must be an int in \[196, "),
    ("SmartResize", "max_pixels_per_row", "all", T, r"SmartResize\.max_pixels_per_row must be an int .*or None"),
    ("SmartResize", "resize_mode", "bicubic", V, r"SmartResize\.resize_mode must be one of \('exact', 'fast'\)"),
    ("ToDevice", "device", "gpu", V, r"ToDevice\.device must be 'cuda', 'cuda:N' or 'cpu'"),
    ("ToDevice", "device", "meta", V, r"ToDevice: unsupported device"),
    ("ToDevice", "device", None, T, r"ToDevice\.device must be a device string"),
    ("ToDevice", "non_blocking", "no", T, r"ToDevice\.non_blocking must be True or False"),
]

FIELDS = [
    ("RGBImage", "max_resolution", "512", T, r"RGBImage\.max_resolution must be an int >= 1 or None"),
    ("RGBImage", "max_resolution", 0, V, r"RGBImage\.max_resolution must be an int >= 1, got 0"),
    ("RGBImage", "max_resolution", 512.0, T, r"RGBImage\.max_resolution"),
    ("RGBImage", "encoding", "png", V, r"RGBImage\.encoding must be one of \('jpeg', 'raw', 'auto'\)"),
    ("RGBImage", "jpeg_quality", 101, V, r"RGBImage\.jpeg_quality must be an int in \[1, 100\], got 101"),
    ("RGBImage", "jpeg_quality", 90.0, T, r"RGBImage\.jpeg_quality"),
    ("RGBImage", "jpeg_subsampling", "420", V, r"RGBImage\.jpeg_subsampling must be one of"),
    ("RGBImage", "auto_raw_ratio", 0, V, r"RGBImage\.auto_raw_ratio must be a finite number > 0"),
    ("RGBImage", "auto_raw_ratio", "4", T, r"RGBImage\.auto_raw_ratio must be a number"),
    ("RGBImage", "jpeg_passthrough", "yes", T, r"RGBImage\.jpeg_passthrough must be True or False"),
    ("RGBImage", "jpeg_draft", 1, T, r"RGBImage\.jpeg_draft must be True or False"),
    ("RGBImage", "jpeg_restart", 65, V, r"RGBImage\.jpeg_restart must be an int in \[0, 64\], got 65"),
    ("RGBImage", "jpeg_restart", 1.0, T, r"RGBImage\.jpeg_restart must be an int"),
    ("Int", "dtype", "int", V, r"Int\.dtype must be one of"),
    ("Int", "dtype", "float32", V, r"Int\.dtype must be one of"),
    ("Float", "dtype", "int32", V, r"Float\.dtype must be one of"),
    ("NDArray", "dtype", "complex64", V, r"NDArray\.dtype must be one of"),
    ("NDArray", "shape", (2, -1), V, r"NDArray\.shape\[1\] must be an int >= 0, got -1"),
    ("NDArray", "shape", (2.5, 3), T, r"NDArray\.shape\[0\] must be an int"),
    ("NDArray", "shape", "3x4", T, r"NDArray\.shape must be a tuple of ints"),
    ("Tokens", "dtype", "int64", V, r"Tokens\.dtype must be one of"),
    ("TokenIds", "dtype", "uint64", V, r"TokenIds\.dtype must be one of \('uint16', 'uint32'\)"),
    ("TokenIds", "dtype", "int32", V, r"TokenIds\.dtype must be one of"),
    ("TokenIds", "loss_mask", 1, T, r"TokenIds\.loss_mask must be True or False"),
    ("RGBImages", "max_resolution", 0, V, r"RGBImage\.max_resolution must be an int >= 1"),
    ("RGBImages", "encoding", "png", V, r"RGBImage\.encoding must be one of"),
    ("RGBImages", "jpeg_quality", 101, V, r"RGBImage\.jpeg_quality must be an int in \[1, 100\]"),
    ("RGBImages", "jpeg_subsampling", "4:1:1", V, r"RGBImage\.jpeg_subsampling must be one of"),
    ("RGBImages", "auto_raw_ratio", 0, V, r"RGBImage\.auto_raw_ratio must be"),
    ("RGBImages", "jpeg_draft", "no", T, r"RGBImage\.jpeg_draft must be True or False"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory, photo_arrays):
    """A small image file, a token file, a nanoGPT .bin, an llm.c .bin and a Megatron pair: valid inputs, so
    that each row's error comes from the one bad argument."""
    d = tmp_path_factory.mktemp("args")
    write_dataset(d / "img.pageset", [(a[:32, :32], k) for k, a in enumerate(photo_arrays[:4])],
                  {"image": RGBImage(), "label": Int()}, num_workers=0, progress=False)
    write_tokens(d / "tok.pageset", [np.arange(1, 200)], None, eos_id=0, num_workers=0, progress=False)
    np.array([5, 6, 50256, 7], dtype=np.uint16).tofile(d / "nano.bin")
    header = np.zeros(256, "<i4")
    header[:3] = (20240520, 1, 3)
    (d / "llmc.bin").write_bytes(header.tobytes() + np.array([50256, 1, 2], "<u2").tobytes())
    return d


LOADER = [
    ("path", 3, T, r"path must be the pageset file's path"),
    ("batch_size", "8", T, r"batch_size must be an int >= 1, got '8'"),
    ("batch_size", 0, V, r"batch_size must be an int >= 1, got 0"),
    ("batch_size", 8.0, T, r"batch_size"),
    ("pipelines", [RandomResizedCrop(16)], T, r"pipelines must be a dict or None, e\.g\. \{'image'"),
    ("order", "shuffle", V, r"order must be one of \('sequential', 'random', 'quasi_random'\), got 'shuffle'"),
    ("seed", None, T, r"seed must be an int in \[0, 18446744073709551615\], got None"),
    ("seed", "0", T, r"seed must be an int .*got '0' \(str\)"),
    ("seed", -1, V, r"seed must be an int in \[0, "),
    ("seed", 2**64, V, r"seed must be an int in \[0, "),
    ("seed", 1.0, T, r"seed"),
    ("drop_last", "False", T, r"drop_last must be True or False, got 'False'"),
    ("drop_last", 0, T, r"drop_last must be True or False"),
    ("num_threads", 0, V, r"num_threads must be an int >= 1"),
    ("num_threads", "4", T, r"num_threads must be an int >= 1 or None"),
    ("batches_ahead", 0, V, r"batches_ahead must be an int >= 1"),
    ("rank", "0", T, r"rank must be an int >= 0 or None"),
    ("rank", -1, V, r"rank must be an int >= 0"),
    ("world_size", 0, V, r"world_size must be an int >= 1"),
    ("page_cache", "mmap", V, r"page_cache must be one of \('os', 'process'\)"),
    ("window_pages", 0, V, r"window_pages must be an int >= 1"),
    ("window_pages", 1.5, T, r"window_pages must be an int >= 1 or None, got 1.5"),
    ("window_records", 0, V, r"window_records must be an int >= 1"),
    ("window_records", "8", T, r"window_records must be an int >= 1 or None, got '8'"),
    ("cache_dir", "", V, r"cache_dir='' names no folder"),
    ("cache_limit_bytes", 1 << 20, V, r"cache_limit_bytes=1,048,576 bounds the on-disk page cache of cache_dir=, "
                                      r"and no cache_dir is given"),
    ("cache_pages", 0, V, r"cache_pages must be an int >= 1"),
    ("verify_pages", "yes", T, r"verify_pages must be True or False"),
    ("array_type", "tensor", V, r"array_type must be one of \('torch', 'numpy'\)"),
    ("indices", "0:4", T, r"indices must be a sequence of record ids"),
    ("indices", [0, 99], V, r"indices\[1\] = 99 is outside \[0, 4\)"),
    ("indices", [0, 1.5], T, r"indices\[1\] = 1\.5 is not an integer record id"),
    ("storage_options", "anon", T, r"storage_options must be a dict or None"),
    ("cache_dir", 5, T, r"cache_dir must be a folder path"),
    ("cache_dir", __file__, NotADirectoryError, r"cache_dir '.*test_arguments\.py' is a file, not a folder"),
    ("indices", {0, 1, 2}, T, r"indices is a set: sets are unordered.*pass a list or 1-D integer array of record ids"),
    ("cache_limit_bytes", 0, V, r"cache_limit_bytes must be an int >= 1"),
    ("prefetch_bytes", -1, V, r"prefetch_bytes must be an int >= 0"),
    ("max_requests", 0, V, r"max_requests must be an int >= 1"),
    ("max_requests", 2.0, T, r"max_requests must be an int >= 1"),
    ("request_timeout", 0, V, r"request_timeout must be a finite number > 0"),
    ("request_timeout", "30", T, r"request_timeout must be a number"),
    ("request_attempts", 0, V, r"request_attempts must be an int >= 1"),
    ("page_options", {"page_cache": "process"}, T, r"page_options must be a pageset\.PageOptions \(or None\)"),
    ("remote_options", "s3", T, r"remote_options must be a pageset\.RemoteOptions \(or None\)"),
    ("num_workers", -1, V, r"num_workers must be an int >= 0, got -1"),
    ("num_workers", 2, V, r"num_workers must be 0 \(decode threads in this process\) or 1 .*got 2: one child "
                          r"process running num_threads threads"),
    ("num_workers", "1", T, r"num_workers must be an int >= 0, got '1'"),
    ("num_workers", 1.0, T, r"num_workers must be an int >= 0"),
]

WRITE_DATASET = [
    ("path", 3, T, r"path must be the output file's path"),
    ("path", "missing/folder/out.pageset", FileNotFoundError, r"the output folder .*missing/folder does not exist"),
    ("fields", [Int()], T, r"fields must be a dict or None, e\.g\."),
    ("num_workers", -1, V, r"num_workers must be an int in \[0, 1024\], got -1"),
    ("num_workers", 10**20, V, r"num_workers must be an int in \[0, 1024\], got 100000000000000000000"),
    ("num_workers", "2", T, r"num_workers must be an int in \[0, 1024\] or None"),
    ("page_size", 3000, V, r"page_size must be a power of two in \[4096, "),
    ("page_size", "4096", T, r"page_size must be an int"),
    ("progress", "no", T, r"progress must be True or False"),
    ("on_error", "ignore", V, r"on_error must be one of \('raise', 'skip'\)"),
    ("metadata", [1, 2], T, r"metadata must be a dict or None"),
    ("chunk_size", 0, V, r"chunk_size must be an int >= 1"),
    ("lineage", None, T, r"lineage must be True or False"),
    ("executor", "dask", T, r"executor must be a concurrent\.futures\.Executor"),
    ("shard_dir", 5, T, r"shard_dir must be a string or None"),
    ("storage_options", "anon=True", T, r"storage_options must be a dict or None"),
    ("request_timeout", 0, V, r"request_timeout must be a finite number > 0"),
    ("request_attempts", 0.5, T, r"request_attempts must be an int >= 1"),
    ("metadata", {"when": object()}, T, r"metadata\['when'\] is not JSON-serialisable"),
    ("records_per_member", 0, V, r"records_per_member must be an int >= 1, got 0"),
    ("records_per_member", "10", T, r"records_per_member must be an int >= 1 or None"),
    ("append", "yes", T, r"append must be True or False"),
    ("append", True, V, r"append=True adds members to a many-file dataset: give records_per_member="),
]

WRITE_TOKENS = [
    ("path", None, T, r"path must be the output file's path"),
    ("path", "missing/out.pageset", FileNotFoundError, r"the output folder .*missing does not exist"),
    ("eos_id", "0", T, r"eos_id must be an int >= 0 or None"),
    ("eos_id", -1, V, r"eos_id must be an int >= 0"),
    ("bos_id", 1.0, T, r"bos_id must be an int >= 0 or None"),
    ("dtype", "int32", V, r"dtype must be one of \('auto', 'uint16', 'uint32'\)"),
    ("num_workers", -2, V, r"num_workers must be an int in \[0, 1024\]"),
    ("num_workers", 1025, V, r"num_workers must be an int in \[0, 1024\], got 1025"),
    ("progress", 1, T, r"progress must be True or False"),
    ("text_key", 3, T, r"text_key must be a string"),
    ("text_key", "", V, r"text_key must be a non-empty string"),
    ("separator", 5, T, r"separator must be a string or None"),
    ("page_size", 12345, V, r"page_size must be a power of two"),
    ("metadata", "x", T, r"metadata must be a dict or None"),
    ("chunk_docs", 0, V, r"chunk_docs must be an int >= 1"),
    ("chunk_chars", "big", T, r"chunk_chars must be an int >= 1"),
    ("lineage", "no", T, r"lineage must be True or False"),
    ("executor", 4, T, r"executor must be a concurrent\.futures\.Executor"),
    ("shard_dir", ["a"], T, r"shard_dir must be a string or None"),
    ("storage_options", [("anon", True)], T, r"storage_options must be a dict or None"),
    ("request_timeout", -1, V, r"request_timeout must be a finite number > 0"),
    ("request_attempts", 0, V, r"request_attempts must be an int >= 1"),
    ("member_bytes", 0, V, r"member_bytes must be an int >= 1, got 0"),
    ("member_bytes", 1.5e9, T, r"member_bytes must be an int >= 1 or None"),
    ("docs_per_member", "100", T, r"docs_per_member must be an int >= 1 or None"),
    ("append", 1, T, r"append must be True or False"),
    ("append", True, V, r"append=True adds members to a many-file set: give member_bytes= or docs_per_member="),
    ("messages_key", 5, T, r"messages_key must be"),
    ("chat_template", 5, T, r"chat_template must be the template text or a path"),
    ("train_on", ("wizard",), V, r"train_on: \['wizard'\] are not roles"),
    ("train_on", (), T, r"train_on must be a non-empty tuple of roles"),
    ("on_error", "ignore", V, r"on_error must be one of \('raise', 'skip'\)"),
    ("on_error", "skip", V, r"on_error='skip' leaves out conversations that cannot be encoded: it needs messages_key="),
]

MERGE = [
    ("path", 3, T, r"path must be the output file's path"),
    ("path", "missing/m.pageset", FileNotFoundError, r"the output folder .*missing does not exist"),
    ("inputs", "a.pageset", T, r"inputs must be a list of pageset file paths, got 'a\.pageset'"),
    ("inputs", [1, 2], T, r"inputs must hold paths"),
    ("progress", "yes", T, r"progress must be True or False"),
    ("page_size", 1000, V, r"page_size must be a power of two"),
    ("metadata", "m", T, r"metadata must be a dict or None"),
    ("lineage", 0, T, r"lineage must be True or False"),
    ("storage_options", 1, T, r"storage_options must be a dict or None"),
    ("request_timeout", "30", T, r"request_timeout must be a number"),
    ("request_attempts", -1, V, r"request_attempts must be an int >= 1"),
    ("metadata", {"when": {1, 2}}, T, r"metadata\['when'\] is not JSON-serialisable"),
]

IMPORTERS = [  # (function, argument, bad value, exception, message)
    ("import_nanogpt", "path", 7, T, r"path must be the output file's path"),
    ("import_nanogpt", "bin_path", None, T, r"the source must be a path"),
    ("import_nanogpt", "dtype", "float32", V, r"dtype must be one of"),
    ("import_nanogpt", "eos_id", "50256", T, r"eos_id must be an int"),
    ("import_nanogpt", "out_dtype", "uint8", V, r"out_dtype must be one of \('auto', 'uint16', 'uint32'\)"),
    ("import_nanogpt", "page_size", 100, V, r"page_size must be a power of two"),
    ("import_nanogpt", "metadata", ["x"], T, r"metadata must be a dict or None"),
    ("import_llmc", "path", b"out", T, r"path must be the output file's path"),
    ("import_llmc", "bin_path", 3.5, T, r"the source must be a path"),
    ("import_llmc", "eos_id", -5, V, r"eos_id must be an int in \[0, "),
    ("import_llmc", "out_dtype", "int64", V, r"out_dtype must be one of"),
    ("import_llmc", "page_size", "8M", T, r"page_size must be an int"),
    ("import_llmc", "metadata", 5, T, r"metadata must be a dict"),
    ("import_megatron", "path", None, T, r"path must be the output file's path"),
    ("import_megatron", "prefix", 12, T, r"prefix must be a path"),
    ("import_megatron", "eos_id", None, T, r"eos_id must be an int"),
    ("import_megatron", "out_dtype", "u16", V, r"out_dtype must be one of"),
    ("import_megatron", "page_size", 0, V, r"page_size must be a power of two"),
    ("import_megatron", "metadata", (1,), T, r"metadata must be a dict"),
]

OTHERS = [  # callables whose arguments are paths (or the inputs of a mixture)
    ("Mixture", "sources", "a.pageset", T, r"sources must be a list of paths"),
    ("Mixture", "sources", [], V, r"^sources is empty: a mixture needs at least one file$"),
    ("Mixture", "sources", range(32768), V, r"32768 sources: at most 32767"),
    ("Mixture", "weight_unit", "rows", V, r"weight_unit must be 'samples' or 'tokens', got 'rows'"),
    ("Mixture", "weight_unit", 1, T, r"weight_unit must be 'samples' or 'tokens'"),
    ("Mixture", "weights", "x", T, r"weights must be a sequence of numbers, one per source"),
    ("Mixture", "weights", [1, -1], V, r"weights\[1\] = -1\.0 is negative"),
    ("Mixture", "samples_per_epoch", 0, V, r"samples_per_epoch must be an int >= 1"),
    ("Mixture", "samples_per_epoch", 2.5, V, r"samples_per_epoch must be an int >= 1 .*got 2\.5"),
    ("Mixture", "weights", pageset.Schedule([(0, [1, 1, 1])]), V, r"the schedule has 3 weights per stage for 2"),
    ("Schedule", "stages", 5, T, r"stages must be a sequence of \(start, weights\) pairs"),
    ("Schedule", "stages", [(3, [1, 1])], V, r"stages\[0\] starts at 3: the first stage starts at position 0"),
    ("Schedule", "interpolate", "cubic", V, r"interpolate = 'cubic': use one of \('step', 'linear'\)"),
    ("Schedule", "interpolate", 1, T, r"interpolate must be 'step', 'linear' or a sequence of them"),
    ("Schedule", "block", 0, V, r"block must be an int in \[1, 1000000\]"),
    ("Schedule", "block", 2.0, V, r"block must be an int in \[1, 1000000\] .*got 2\.0"),
    ("ParquetSource", "paths", 3, T, r"paths must be a path or URL"),
    ("ParquetSource", "columns", "text", T, r"columns must be a dict or None"),
    ("ParquetSource", "storage_options", "anon", T, r"storage_options must be a dict or None, e\.g\. \{'anon': True\}"),
    ("WebDatasetSource", "urls", 3, T, r"urls must be a path or URL"),
    ("WebDatasetSource", "fields", ["jpg"], V, r"fields must map field names to member extensions"),
    ("WebDatasetSource", "storage_options", ["anon"], T, r"storage_options must be a dict or None, e\.g\. \{'anon': True\}"),
    ("open_dataset", "path", 0, T, r"path must be the pageset file's path"),
    ("open_dataset", "storage_options", ["x"], T, r"storage_options must be a dict or None"),
    ("open_dataset", "request_timeout", -1, V, r"request_timeout must be a finite number > 0"),
    ("open_dataset", "request_attempts", "5", T, r"request_attempts must be an int >= 1"),
    ("open_tokens", "path", None, T, r"path must be the pageset file's path"),
    ("open_tokens", "storage_options", 1, T, r"storage_options must be a dict or None"),
    ("ImageFolder", "root", 3, T, r"ImageFolder\.root must be a folder path"),
    ("ImageList", "path", ["a.jpg"], T, r"ImageList\.path must be the file list's path"),
    ("PagesetDatasink", "path", 3, T, r"path must be the output folder's path or URL"),
    ("PagesetDatasink", "path", "https://host/x", V, r"http\(s\) URLs are read-only"),
    ("PagesetDatasink", "fields", ["image"], T, r"fields must be a dict"),
    ("PagesetDatasink", "fields", {}, V, r"fields must name at least one column"),
    ("PagesetDatasink", "records_per_member", 0, V, r"records_per_member must be an int >= 1"),
    ("PagesetDatasink", "page_size", 1000, V, r"page_size must be"),
    ("PagesetDatasink", "append", "yes", T, r"append must be True or False"),
    ("PagesetDatasink", "on_error", "ignore", V, r"on_error must be one of"),
    ("PagesetDatasink", "storage_options", ["x"], T, r"storage_options must be a dict or None"),
    ("PagesetDatasink", "metadata", {"x": {1, 2}}, T, r"metadata"),
    ("PagesetDatasink", "lineage", 1, T, r"lineage must be True or False"),
    ("PageOptions", "page_cache", "mmap", V, r"page_cache must be one of \('os', 'process'\)"),
    ("PageOptions", "page_cache", dict, V, r"page_cache must be one of"),  # a class that is no PageSource
    ("PageOptions", "cache_pages", 0, V, r"cache_pages must be an int >= 1"),
    ("PageOptions", "verify_pages", 1, T, r"verify_pages must be True or False"),
    ("PageOptions", "window_pages", 0, V, r"window_pages must be an int >= 1"),
    ("PageOptions", "window_records", "8", T, r"window_records must be an int >= 1 or None"),
    ("RemoteOptions", "storage_options", "anon", T, r"storage_options must be a dict or None"),
    ("RemoteOptions", "cache_dir", 5, T, r"cache_dir must be a folder path"),
    ("RemoteOptions", "cache_limit_bytes", 0, V, r"cache_limit_bytes must be an int >= 1"),
    ("RemoteOptions", "prefetch_bytes", -1, V, r"prefetch_bytes must be an int >= 0"),
    ("RemoteOptions", "max_requests", 0, V, r"max_requests must be an int >= 1"),
    ("RemoteOptions", "request_timeout", "30", T, r"request_timeout must be a number"),
    ("RemoteOptions", "request_attempts", 0, V, r"request_attempts must be an int >= 1"),
    ("RayExecutor", "max_retries", -1, V, r"max_retries must be an int >= 0, got -1"),
    ("RayExecutor", "max_retries", "3", T, r"max_retries must be an int >= 0"),
    ("RayExecutor", "num_cpus", 0, V, r"num_cpus must be a finite number > 0"),
    ("RayExecutor", "num_cpus", "1", T, r"num_cpus must be a number"),
    ("RayExecutor", "memory", 0, V, r"memory must be an int >= 1"),
    ("RayExecutor", "memory", 1.5, T, r"memory must be an int >= 1 or None"),
    ("ChatTokenizer", "tokenizer", 5, T, r"tokenizer must be a tokenizer\.json path"),
    ("ChatTokenizer", "chat_template", 5, V, r"no chat_template in it"),
    ("ChatTokenizer", "train_on", ("robot",), V, r"train_on: \['robot'\] are not roles"),
    ("ChatTokenizer", "image_token", 5, T, r"image_token is the placeholder's text"),
    ("LlavaSource", "data", b"x.json", T, r"LlavaSource\.data must be a LLaVA JSON/JSONL file's path or a sequence"),
    ("LlavaSource", "image_folder", 5, T, r"LlavaSource\.image_folder must be a folder path"),
    ("LlavaSource", "entry", "", T, r"LlavaSource\.entry must be a key"),
    ("LlavaSource", "chat", "tokenizer.json", T, r"LlavaSource\.chat must be a pageset\.ChatTokenizer"),
    ("LlavaSource", "conversation", "", T, r"LlavaSource\.conversation must be a non-empty str"),
    ("LlavaSource", "images", "conversation", V, r"conversation and images name the same field"),
    ("LlavaSource", "placeholder", 5, T, r"LlavaSource\.placeholder must be a non-empty str"),
    ("ChatTokenizer", "image_token", "<image>", V, r"image_token '<image>' is 3 tokens of this tokenizer, not one"),
]


@pytest.mark.parametrize("name, arg, value, exc, match", OPS + FIELDS + OTHERS,
                         ids=[f"{r[0]}.{r[1]}={r[2]!r}" for r in OPS + FIELDS + OTHERS])
def test_constructor_refuses_bad_argument(name, arg, value, exc, match):
    kw = {"TokenWindows": {"seq_len": 8}, "PadTokens": {"max_length": 8}, "Mixture": {"sources": ["a.pageset", "b.pageset"], "weights": [1, 1]},
          "Schedule": {"stages": [(0, [1, 1]), (10, [1, 2])]},
          "ParquetSource": {"paths": "x.parquet"}, "open_dataset": {"path": "x.pageset"},
          "open_tokens": {"path": "x.pageset"}, "WebDatasetSource": {"urls": "x.tar", "fields": {"a": "jpg"}},
          "PagesetDatasink": {"path": "out", "fields": {"label": Int()}},
          "ExpandImageTokens": {"image_token_id": 7, "tokens_per_image": 4},
          "ChatTokenizer": {"tokenizer": GPT2_FILES, "chat_template": "{{ messages[0]['content'] }}"},
          }.get(name, {})  # the other required arguments, valid
    if name == "LlavaSource":  # a ChatTokenizer with an image token ("hello" is one GPT-2 token)
        kw = {"data": [],
              "chat": pageset.ChatTokenizer(GPT2_FILES, chat_template="{{ messages[0]['content'] }}",
                                            image_token="hello")}
    with pytest.raises(exc, match=match):
        getattr(pageset, name)(**{**kw, arg: value})


@pytest.mark.parametrize("arg, value, exc, match", LOADER, ids=[f"{r[0]}={r[1]!r}" for r in LOADER])
def test_loader_refuses_bad_argument(files, arg, value, exc, match):
    kw = {"path": files / "img.pageset", "batch_size": 2, "pipelines": {"image": [RandomResizedCrop(16)]},
          "num_threads": 1}
    kw[arg] = value
    with pytest.raises(exc, match=match):
        Loader(**kw)


@pytest.mark.parametrize("arg, value, exc, match", WRITE_DATASET, ids=[f"{r[0]}={r[1]!r}" for r in WRITE_DATASET])
def test_write_dataset_refuses_bad_argument_before_reading(tmp_path, monkeypatch, arg, value, exc, match):
    class Untouchable:
        def __len__(self):
            return 3

        def __getitem__(self, i):
            raise AssertionError("the source was read before the arguments were checked")

    monkeypatch.chdir(tmp_path)
    kw = {"path": tmp_path / "out.pageset", "source": Untouchable(), "fields": {"y": Int()}, "num_workers": 0,
          "progress": False}
    kw[arg] = value
    with pytest.raises(exc, match=match):
        write_dataset(**kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written, no temp file


@pytest.mark.parametrize("arg, value, exc, match", WRITE_TOKENS, ids=[f"{r[0]}={r[1]!r}" for r in WRITE_TOKENS])
def test_write_tokens_refuses_bad_argument_before_reading(tmp_path, monkeypatch, arg, value, exc, match):
    def untouchable():
        raise AssertionError("the source was read before the arguments were checked")
        yield  # pragma: no cover

    monkeypatch.chdir(tmp_path)
    kw = {"path": tmp_path / "out.pageset", "source": untouchable(), "tokenizer": None, "eos_id": 0,
          "num_workers": 0, "progress": False}
    kw[arg] = value
    with pytest.raises(exc, match=match):
        write_tokens(**kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("arg, value, exc, match", MERGE, ids=[f"{r[0]}={r[1]!r}" for r in MERGE])
def test_merge_datasets_refuses_bad_argument_before_reading(files, tmp_path, monkeypatch, arg, value, exc, match):
    monkeypatch.chdir(tmp_path)
    kw = {"path": tmp_path / "m.pageset", "inputs": [files / "img.pageset"] * 2, "progress": False}
    kw[arg] = value
    with pytest.raises(exc, match=match):
        pageset.merge_datasets(**kw)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fn, arg, value, exc, match", IMPORTERS, ids=[f"{r[0]}.{r[1]}={r[2]!r}" for r in IMPORTERS])
def test_importer_refuses_bad_argument(files, tmp_path, fn, arg, value, exc, match):
    from test_tokens import _megatron

    _megatron(tmp_path / "m", [[[1, 2, 0]], [[3, 0]]])
    source = {"import_nanogpt": ("bin_path", files / "nano.bin"), "import_llmc": ("bin_path", files / "llmc.bin"),
              "import_megatron": ("prefix", tmp_path / "m")}[fn]
    kw = {"path": tmp_path / "out.pageset", source[0]: source[1], "eos_id": 0}
    kw[arg] = value
    with pytest.raises(exc, match=match):
        getattr(pageset, fn)(**kw)
    assert not (tmp_path / "out.pageset").exists()


def test_valid_values_are_normalised():
    """What the checks accept: torchvision's size convention, numpy scalars and arrays, dtype objects."""
    assert RandomResizedCrop(np.int64(32)).size == (32, 32)
    assert CenterCrop([24, 32]).size == (24, 32)
    assert RandomResizedCrop(16, scale=np.array([0.5, 1.0])).scale == (0.5, 1.0)
    assert Normalize(dtype=torch.bfloat16).dtype == "bfloat16" and Normalize(dtype=np.float16).dtype == "float16"
    assert Normalize(mean=np.array([0.5, 0.5, 0.5])).mean == (0.5, 0.5, 0.5)
    assert Int(np.int32).dtype == "int32" and Float(np.dtype("float16")).dtype == "float16"
    assert NDArray("uint8", np.array([2, 3])).shape == (2, 3) and NDArray("uint8", 4).shape == (4,)
    assert IntDecoder(np.int32).dtype == "int32" and FloatDecoder("float64").dtype == "float64"
    assert RGBImage(max_resolution=np.int64(64)).max_resolution == 64
    assert ToTorchImage(np.bool_(False)).channels_last is False
    assert TokenWindows(np.int32(8)).seq_len == 8 and ToDevice(torch.device("cpu")).device == torch.device("cpu")
    assert Tokens(np.uint32).dtype == "uint32" and JSON() == JSON()


def _table_coverage() -> dict[str, set[str]]:
    rows = [(r[0], r[1]) for r in OPS + FIELDS + OTHERS + IMPORTERS]
    rows += [("Loader", r[0]) for r in LOADER] + [("write_dataset", r[0]) for r in WRITE_DATASET]
    rows += [("write_tokens", r[0]) for r in WRITE_TOKENS] + [("merge_datasets", r[0]) for r in MERGE]
    covered: dict[str, set[str]] = {}
    for name, arg in rows:
        covered.setdefault(name, set()).add(arg)
    return covered


# Arguments with tests of their own elsewhere (what a source / tokenizer may be is a larger contract).
OWN_TESTS = {("write_dataset", "source"), ("write_tokens", "source"), ("write_tokens", "tokenizer")}


def test_every_public_argument_is_in_the_table():
    """A new public class or argument fails here until it has a row above (or a documented exception)."""
    covered = _table_coverage()
    missing = []
    for name in pageset.__all__:
        obj = getattr(pageset, name)
        if not callable(obj) or (isinstance(obj, type) and issubclass(obj, BaseException)):
            continue
        if name in ("Dataset", "TokenDataset", "EncodedImage", "WriteResult", "TokenWriteResult", "document_outputs",
                    "gather_windows"):
            continue  # handles and results pageset makes (opened via open_dataset/open_tokens); array kernels
        for param in inspect.signature(obj).parameters.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or (name, param.name) in OWN_TESTS:
                continue
            if param.name not in covered.get(name, set()):
                missing.append(f"{name}({param.name}=...)")
    assert not missing, f"public arguments without a bad-value row in tests/test_arguments.py: {missing}"


LOADER_METHODS = [  # (Loader method, argument, bad value, exception, message)
    ("stats", "reset", "yes", T, r"reset must be True or False"),
    ("stats", "reset", 1, T, r"reset must be True or False"),
    ("bottleneck", "step_seconds", 0, V, r"step_seconds must be a finite number > 0"),
    ("bottleneck", "step_seconds", -1.0, V, r"step_seconds must be a finite number > 0"),
    ("bottleneck", "step_seconds", float("nan"), V, r"step_seconds must be a finite number > 0"),
    ("bottleneck", "step_seconds", "25ms", T, r"step_seconds must be a number"),
]


@pytest.mark.parametrize("method, arg, value, exc, match", LOADER_METHODS,
                         ids=[f"{r[0]}.{r[1]}={r[2]!r}" for r in LOADER_METHODS])
def test_loader_method_refuses_bad_argument(files, method, arg, value, exc, match):
    with Loader(files / "img.pageset", batch_size=2, pipelines={"image": [RandomResizedCrop(16)]},
                num_threads=1) as ld:
        with pytest.raises(exc, match=match):
            getattr(ld, method)(**{arg: value})
