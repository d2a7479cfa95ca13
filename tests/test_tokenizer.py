"""Kimi's tokenizer format: round trips, the chat template, synth -> convert -> run with text."""

from __future__ import annotations

import base64
import dataclasses
import json
import shutil

import pytest

from waste.cli import main
from waste.config import load_preset
from waste.testing import tiny_container
from waste.tokenizer import (
    CONFIG_FILE,
    CONTAINER_DIR,
    TIKTOKEN_FILE,
    container_tokenizer,
    load_tokenizer,
    synthetic_tokenizer_files,
    train_bpe,
    write_files,
)

TEXTS = [
    "Hello, world! The capital of France is Paris.",
    "你好，世界 and naïve café: 12345 + 0.5e-3\n\n\tindented\r\nlines   ",
    "<|im_user|>user<|im_middle|>Hi<|im_end|>[BOS]<|reserved_token_800|>[PAD]",
    "emoji 🙂 and bytes \x00\x7f",
    "",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A synthetic tokenizer with room for merges: vocab 1024 = 768 mergeable + 256 special."""
    cfg = dataclasses.replace(load_preset("tiny"), vocab_size=1024, bos_token_id=768, eos_token_id=770,
                              pad_token_id=1023)
    d = tmp_path_factory.mktemp("tok")
    write_files(d, synthetic_tokenizer_files(cfg))
    return d


@pytest.mark.parametrize("text", TEXTS)
def test_encode_then_decode_gives_the_text_back(tokenizer_dir, text):
    tok = load_tokenizer(tokenizer_dir)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    stream = tok.stream()
    assert "".join(stream.push(i) for i in ids) + stream.flush() == text


def test_special_tokens_are_single_ids_where_kimi_puts_them(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    assert (tok.bos_id, tok.eos_id) == (768, 770)
    assert tok.encode("[BOS]<|im_end|><|im_middle|>[PAD]") == [768, 770, 768 + 17, 1023]
    assert tok.encode("<|reserved_token_800|>") == [800]
    assert tok.stop_ids() == {770}
    assert tok.encoding.n_vocab == 1024 + 2  # Kimi's two extra reserved ids past the vocabulary


def test_merges_shorten_common_text(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    text = "The capital of France is Paris."
    assert len(tok.encode(text)) < len(text.encode()) / 2
    assert tok.token_text(tok.encode(" the")[0]) == " the"


def test_two_turn_chat_template_matches_kimi_format(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
                {"role": "user", "content": "And 3+3?"}]
    expected = ("<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>"
                "<|im_user|>user<|im_middle|>What is 2+2?<|im_end|>"
                "<|im_assistant|>assistant<|im_middle|>4.<|im_end|>"
                "<|im_user|>user<|im_middle|>And 3+3?<|im_end|>"
                "<|im_assistant|>assistant<|im_middle|>")
    assert tok.apply_chat_template(messages) == expected
    with_system = [{"role": "system", "content": "Be brief."}, messages[0]]
    assert tok.apply_chat_template(with_system, add_generation_prompt=False) == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>What is 2+2?<|im_end|>")


def test_bpe_ranks_are_reachable_merges():
    tokens = train_bpe("abab abab abab cdcd", 300)
    assert tokens[:256] == [bytes([b]) for b in range(256)]
    assert len(set(tokens)) == 300
    assert tokens[256] in (b"ab", b" ab")
    for i, t in enumerate(tokens[256:], 256):
        assert any(t[:k] in tokens[:i] and t[k:] in tokens[:i] for k in range(1, len(t))), t


def test_presets_get_kimis_special_ids():
    for preset in ("tiny", "mini", "kimi-linear-48b-a3b"):
        cfg = load_preset(preset)
        files = synthetic_tokenizer_files(cfg)
        ranks = files[TIKTOKEN_FILE].splitlines()
        assert len(ranks) == cfg.vocab_size - 256
        added = json.loads(files[CONFIG_FILE])["added_tokens_decoder"]
        assert added[str(cfg.bos_token_id)]["content"] == "[BOS]"
        assert added[str(cfg.eos_token_id)]["content"] == "<|im_end|>"
        assert added[str(cfg.pad_token_id)]["content"] == "[PAD]"
    odd = dataclasses.replace(load_preset("tiny"), bos_token_id=1)
    assert synthetic_tokenizer_files(odd) is None


def test_bad_tiktoken_file_is_one_clear_error(tmp_path):
    (tmp_path / TIKTOKEN_FILE).write_bytes(base64.b64encode(b"a") + b" 0\n")
    with pytest.raises(Exception, match="single bytes have no token"):
        load_tokenizer(tmp_path)
    (tmp_path / TIKTOKEN_FILE).write_bytes(b"not base64 at all\n")
    with pytest.raises(Exception, match="line 1"):
        load_tokenizer(tmp_path)


def test_convert_carries_the_tokenizer(tmp_path_factory):
    container = tiny_container(tmp_path_factory, quant="f32")
    tok = container_tokenizer(container)
    assert tok is not None and tok.bos_id == 256
    manifest = json.loads((container / "manifest.json").read_text())
    assert set(manifest["source"]["tokenizer"]) == {TIKTOKEN_FILE, CONFIG_FILE}
    assert tok.decode(tok.encode("hi <|im_end|>")) == "hi <|im_end|>"


def test_run_with_text_streams_a_reply(tmp_path_factory, capsys):
    container = tiny_container(tmp_path_factory, quant="f32")
    assert main(["run", str(container), "--prompt", "Hello", "--max-new", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    generated = [int(t) for t in next(x for x in out if x.startswith("generated:")).split(":")[1].split(",")]
    tok = container_tokenizer(container)
    assert out[0] == tok.decode([t for t in generated if t not in tok.stop_ids()])
    assert main(["run", str(container), "--prompt-ids", ",".join(map(str, tok.encode("Hello"))),
                 "--max-new", "3"]) == 0
    assert f"generated: {','.join(map(str, generated))}" in capsys.readouterr().out


def test_chat_continues_a_session(tmp_path_factory, tmp_path, capsys):
    container = tiny_container(tmp_path_factory, quant="f32")
    tok = container_tokenizer(container)
    session = tmp_path / "chat.session"
    assert main(["run", str(container), "--chat", "Hi", "--max-new", "2", "--session-out", str(session)]) == 0
    first = capsys.readouterr().out
    assert main(["run", str(container), "--chat", "Again", "--max-new", "2", "--session-in", str(session),
                 "--session-out", str(session)]) == 0
    capsys.readouterr()
    from waste.container.reader import open_container
    from waste.engine.model import Model

    with open_container(container) as c:
        tokens = Model(c).load_session(session).tokens
    text = tok.decode(tokens)
    assert text.startswith("<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>"
                           "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>")
    assert "<|im_end|><|im_user|>user<|im_middle|>Again<|im_end|><|im_assistant|>assistant<|im_middle|>" in text
    assert "generated:" in first


def test_text_on_a_container_without_tokenizer_is_one_line(tmp_path_factory, tmp_path, capsys):
    container = tiny_container(tmp_path_factory, quant="f32")
    bare = tmp_path / "bare.waste"
    shutil.copytree(container, bare)
    shutil.rmtree(bare / CONTAINER_DIR)
    assert main(["run", str(bare), "--prompt", "Hello"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # The manifest lists the files: they are missing, not absent from the checkpoint.
    assert len(err) == 1 and f"{CONTAINER_DIR}/{TIKTOKEN_FILE}: missing" in err[0]
    assert main(["run", str(bare), "--prompt-ids", "1,2", "--max-new", "1"]) == 0


def test_damaged_tokenizer_is_refused(tmp_path_factory, tmp_path, capsys):
    container = tiny_container(tmp_path_factory, quant="f32")
    bad = tmp_path / "bad.waste"
    shutil.copytree(container, bad)
    path = bad / CONTAINER_DIR / CONFIG_FILE
    path.write_bytes(path.read_bytes().replace(b"helpful", b"harmful"))
    assert main(["run", str(bad), "--chat", "Hi"]) == 2
    assert "does not match the manifest" in capsys.readouterr().err
    # waste verify reads the tokenizer's files too: damaged, then one of them missing.
    assert main(["verify", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{CONFIG_FILE}: does not match the manifest" in err and err.count("\n") == 1
    (bad / CONTAINER_DIR / TIKTOKEN_FILE).unlink()
    assert main(["verify", str(bad)]) == 2
    out, err = capsys.readouterr()
    # both problems in verify's list on stdout, the first of them on stderr's one line
    assert f"{TIKTOKEN_FILE}: missing" in out and f"{CONFIG_FILE}: does not match the manifest" in out
    assert err.count("\n") == 1 and "(and 1 more problem, listed on stdout)" in err
    assert main(["verify", str(container)]) == 0


def test_a_checkpoint_without_tokenizer_gives_a_container_without_one(tmp_path, capsys):
    from waste.container.convert import convert
    from waste.synth import synthesize

    hf = synthesize("tiny", tmp_path / "hf", dtype="f32")
    for name in (TIKTOKEN_FILE, CONFIG_FILE):
        (hf / name).unlink()
    out = convert(hf, tmp_path / "c.waste", quant="f32", progress=False)
    assert container_tokenizer(out) is None
    assert main(["verify", str(out)]) == 0
    capsys.readouterr()
    assert main(["run", str(out), "--prompt", "Hello", "--max-new", "1"]) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer (the checkpoint it was converted from had no tiktoken.model)" in err
    assert err.count("\n") == 1


def test_a_stream_holds_back_a_split_character_and_flush_shows_what_was_left(tokenizer_dir):
    """The two bytes of "é" as two tokens: nothing until the second; a reply that ends after the
    first gets the replacement character from flush, not silence."""
    tok = load_tokenizer(tokenizer_dir)
    first, second = (tok.encoding.encode_single_token(bytes([b])) for b in "é".encode())
    stream = tok.stream()
    assert stream.push(first) == "" and stream.push(second) == "é" and stream.flush() == ""
    stream = tok.stream()
    assert stream.push(first) == "" and stream.flush() == "\ufffd"
