"""Tokenizers and chat templates built from a handshake: bytes and Hugging Face kinds."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from bridge_schema.messages import Handshake
from host.errors import DriverFailed, InvalidRequest
from host.tokenizer import BytesTokenizer, ChatTemplate, tokenizer_from_handshake


def test_bytes_tokenizer_round_trips_utf8_and_drops_special_tokens() -> None:
    tok = BytesTokenizer(vocab_size=260)
    ids = tok.encode("héllo ✓")
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode([*ids, 256, 258]) == "héllo ✓"
    assert tok.decode([0xC3]) == "\ufffd"  # a cut multi-byte character is replaced, not an error


def test_bytes_tokenizer_from_handshake_uses_its_chat_template() -> None:
    template = (
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    tok = tokenizer_from_handshake(Handshake(vocab_size=300, tokenizer_kind="bytes", chat_template=template))
    assert tok.apply_chat_template([("user", "hi"), ("assistant", "yo")], add_generation_prompt=True) == (
        "[user]hi[assistant]yo>"
    )


def test_default_template_is_chatml() -> None:
    text = ChatTemplate("").render([("system", "s"), ("user", "u")], add_generation_prompt=True)
    assert text == "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n"


def test_templates_run_sandboxed_and_raise_clear_errors() -> None:
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(InvalidRequest):
        ChatTemplate(escape).render([("user", "x")], add_generation_prompt=False)
    with pytest.raises(InvalidRequest, match="roles must alternate"):
        ChatTemplate("{{ raise_exception('roles must alternate') }}").render([], add_generation_prompt=False)
    with pytest.raises(DriverFailed, match="does not compile"):
        ChatTemplate("{% for %}")


def _tiny_hf_tokenizer() -> str:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["hello world, hello wafer"] * 20, trainer)
    return tok.to_str()


def test_huggingface_tokenizer_from_handshake() -> None:
    data = _tiny_hf_tokenizer()
    handshake = Handshake(
        vocab_size=320,
        tokenizer_kind="huggingface",
        tokenizer_data=data,
        stop_token_ids=np.array([2], dtype=np.uint32),
        chat_template="{{ messages[0].content }}{{ eos_token }}",
    )
    tok = tokenizer_from_handshake(handshake)
    ids = tok.encode("<|im_start|>hello world")
    assert ids[0] == 1  # special tokens written in text stay special
    assert tok.decode(ids) == "<|im_start|>hello world"
    assert tok.apply_chat_template([("user", "hi")], add_generation_prompt=False) == "hi<|im_end|>"


def test_bad_tokenizers_in_a_handshake_are_driver_errors() -> None:
    with pytest.raises(DriverFailed, match="tokenizer kind"):
        tokenizer_from_handshake(Handshake(vocab_size=300, tokenizer_kind="sentencepiece"))
    with pytest.raises(DriverFailed, match="does not load"):
        tokenizer_from_handshake(Handshake(vocab_size=300, tokenizer_kind="huggingface", tokenizer_data="{"))
