"""Kimi's tokenizer, read from its own files and run offline through `tiktoken`.

A Kimi checkpoint ships `tiktoken.model` (one `base64(token bytes) rank` line per mergeable
token, ranks 0..N-1) and `tokenizer_config.json` (`added_tokens_decoder`: id -> special token,
`bos_token`, `eos_token`, `chat_template`). As Kimi's `tokenization_kimi.py` reads them, the
special tokens take the ids N .. N+257 right after the mergeable ones, named by
`added_tokens_decoder` where it names them and `<|reserved_token_ID|>` elsewhere; text is
pre-split with Kimi's pattern (Han runs, cased words with English contractions, numbers of up
to three digits, punctuation, newlines, spaces) and every special token is allowed in text.

`synthetic_tokenizer_files` makes a small tokenizer in the same format for a preset: a byte
level BPE trained on a short built-in text, filled up with byte pairs so that the N mergeable
tokens plus the 256 special ones match the config's vocab_size and the specials land where
Kimi's are (bos N, eos N+2, pad N+255, as Kimi-Linear's 163584 / 163586 / 163839).
"""

from __future__ import annotations

import base64
import codecs
import itertools
import json
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from waste.config import ModelConfig
from waste.errors import WasteError
from waste.fileio import write_atomic

TIKTOKEN_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
TOKENIZER_FILES = (TIKTOKEN_FILE, CONFIG_FILE)
CONTAINER_DIR = "tokenizer"  # where a container keeps the two files
NUM_RESERVED_SPECIAL = 256  # special ids after the mergeable tokens (Kimi adds two more past them)

# Kimi's pre-tokenisation pattern (tiktoken / fancy-regex syntax; `&&` intersects classes).
PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# Kimi's named special tokens by offset from the first special id (Kimi-Linear: 163584 + offset).
KIMI_SPECIALS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>",
    18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>",
    22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]",
}
BOS_OFFSET, EOS_OFFSET, PAD_OFFSET = 0, 2, 255  # Kimi-Linear's config: bos 163584, eos 163586, pad 163839

# Kimi's chat template as its tokenizer_config.json has it (Kimi-Linear / K2 family), in Jinja.
CHAT_TEMPLATE = (
    "{%- if tools -%}\n"
    "  <|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>\n"
    "{%- endif -%}\n"
    "{%- for message in messages -%}\n"
    "  {%- if loop.first and messages[0]['role'] != 'system' -%}\n"
    "    <|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>\n"
    "  {%- endif -%}\n"
    "  {%- if message['role'] == 'system' -%}\n"
    "    <|im_system|>system<|im_middle|>\n"
    "  {%- elif message['role'] == 'user' -%}\n"
    "    <|im_user|>user<|im_middle|>\n"
    "  {%- elif message['role'] == 'assistant' -%}\n"
    "    <|im_assistant|>assistant<|im_middle|>\n"
    "  {%- elif message['role'] == 'tool' -%}\n"
    "    <|im_system|>tool<|im_middle|>\n"
    "  {%- endif -%}\n"
    "  {%- if message['content'] is string -%}\n"
    "    {{ message['content'] }}\n"
    "  {%- elif message['content'] is not none -%}\n"
    "    {%- for part in message['content'] -%}{{ part['text'] }}{%- endfor -%}\n"
    "  {%- endif -%}\n"
    "  <|im_end|>\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  <|im_assistant|>assistant<|im_middle|>\n"
    "{%- endif -%}"
)

# The synthetic tokenizer's merges are learned from this text (and filled up with byte pairs).
_TRAINING_TEXT = """\
WASTE runs Kimi's hybrid models on one machine. Kimi Delta Attention keeps a state whose size
does not grow with the context, and one layer in four is multi-head latent attention over a
compressed cache. The routed experts of the mixture stream from the disk into a cache in memory.
The state of a layer is a matrix per head; each token decays it, then writes a rank-one update.
The router scores every expert, keeps the best few, and the token's output is their weighted sum.
You are a helpful assistant. What is the capital of France? The capital of France is Paris.
How many experts does the model read for each token? It reads eight routed experts and one
shared expert in every layer after the first. Which term binds the decode speed: the memory
bandwidth, the disk or the compute? Numbers 1, 2, 3, 10, 42, 128, 2304 and 163840 appear too.
"""


@dataclass
class Tokenizer:
    """Kimi's tokenizer: text <-> ids, special tokens, and the chat template."""

    encoding: Any  # tiktoken.Encoding
    special_ids: dict[str, int]
    bos_id: int | None
    eos_id: int | None
    chat_template: str | None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text become their ids (as Kimi does)."""
        return self.encoding.encode(text, allowed_special="all")

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids` (bytes that are not UTF-8 become U+FFFD)."""
        return self.token_bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, ids: Sequence[int]) -> bytes:
        for i in ids:
            if not 0 <= int(i) < self.encoding.n_vocab:
                raise WasteError(f"token id {i} is outside the tokenizer's {self.encoding.n_vocab} ids")
        return b"".join(self.encoding.decode_single_token_bytes(int(i)) for i in ids)

    def token_text(self, token: int) -> str:
        """One token as readable text: its string, with bytes that are not whole UTF-8 as <0xNN>."""
        raw = self.token_bytes([token])
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "".join(f"<0x{b:02X}>" for b in raw)

    def stream(self) -> TextStream:
        """An incremental decoder: feed ids one at a time, get back the text they complete."""
        return TextStream(self)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """The conversation as the text the model reads, rendered by the tokenizer's chat template."""
        if not self.chat_template:
            raise WasteError("this tokenizer has no chat template (tokenizer_config.json has no chat_template)")
        return render_chat_template(self.chat_template, messages, add_generation_prompt)

    def stop_ids(self) -> set[int]:
        """Ids that end an assistant turn: eos and <|im_end|> where they exist."""
        out = {self.eos_id} if self.eos_id is not None else set()
        if "<|im_end|>" in self.special_ids:
            out.add(self.special_ids["<|im_end|>"])
        return out


class TextStream:
    """Decodes a growing id sequence to text, holding back bytes until they form whole characters."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._utf8.decode(self.tokenizer.token_bytes([token]))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


def render_chat_template(template: str, messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> str:
    """Render a Hugging Face chat template the way transformers does (sandboxed Jinja, trimmed blocks)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise WasteError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=list(messages), tools=None,
                                                add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as e:
        raise WasteError(f"chat template: {e}") from None


def _parse_ranks(data: bytes, where: Path) -> dict[bytes, int]:
    """tiktoken.model lines `base64 rank`, parsed locally (tiktoken's own loader may fetch URLs)."""
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise WasteError(f"{where}: line {n} is not `base64-token rank`") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise WasteError(f"{where}: ranks are not 0..{len(ranks) - 1}, each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise WasteError(f"{where}: {len(missing)} single bytes have no token (first 0x{missing[0]:02X})")
    return ranks


def tokenizer_from_files(files: dict[str, bytes], directory: Path) -> Tokenizer:
    """The tokenizer of these file contents (tiktoken.model and, if present, tokenizer_config.json),
    built offline; `directory` names them in messages."""
    import tiktoken

    ranks = _parse_ranks(files[TIKTOKEN_FILE], directory / TIKTOKEN_FILE)
    try:
        cfg = json.loads(files[CONFIG_FILE]) if CONFIG_FILE in files else {}
    except ValueError as e:
        raise WasteError(f"{directory / CONFIG_FILE}: not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise WasteError(f"{directory / CONFIG_FILE}: not a JSON object")
    named = {int(i): (v["content"] if isinstance(v, dict) else str(v))
             for i, v in (cfg.get("added_tokens_decoder") or {}).items()}
    n = len(ranks)
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + NUM_RESERVED_SPECIAL + 2)}
    encoding = tiktoken.Encoding(name=TIKTOKEN_FILE, pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=specials)

    def special(key: str) -> int | None:
        token = cfg.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        return specials.get(token) if isinstance(token, str) else None

    return Tokenizer(encoding, specials, special("bos_token"), special("eos_token"), cfg.get("chat_template"))


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """The tokenizer in `directory` (tiktoken.model + tokenizer_config.json), built offline."""
    directory = Path(directory)
    files = {}
    for name in TOKENIZER_FILES:
        try:
            files[name] = (directory / name).read_bytes()
        except FileNotFoundError:
            if name == TIKTOKEN_FILE:
                raise WasteError(f"{directory / name}: no such file") from None
        except OSError as e:
            raise WasteError(f"{directory / name}: cannot read it ({e.strerror})") from None
    return tokenizer_from_files(files, directory)


def has_tokenizer(directory: str | Path) -> bool:
    return (Path(directory) / TIKTOKEN_FILE).is_file()


def container_tokenizer(container: Any) -> Tokenizer | None:
    """The tokenizer a container carries, or None. `container` is an open Container or a path.

    Its files are read as the container's data is, relative to the container's directory handle
    and checked against the size and CRC32C the manifest lists (`Container.read_side_file`)."""
    from waste.container.reader import Container, open_container

    if not isinstance(container, Container):
        with open_container(container, verify=False) as c:  # the manifest is checked; that is all this needs
            return container_tokenizer(c)
    listed = listed_tokenizer_files(container)
    if not listed:
        try:
            os.stat(f"{CONTAINER_DIR}/{TIKTOKEN_FILE}", dir_fd=container.dir_fd)
        except FileNotFoundError:
            return None  # converted from a checkpoint without one: text needs one, token ids do not
        except OSError:
            pass
        raise WasteError(f"{container.path / CONTAINER_DIR}: the container's manifest does not list these tokenizer "
                         "files")
    # Listed: a file that is missing or damaged is named (`read_side_file`), never taken for "none".
    files = {name: container.read_side_file(f"{CONTAINER_DIR}/{name}", record) for name, record in listed.items()}
    return tokenizer_from_files(files, container.path / CONTAINER_DIR)


def listed_tokenizer_files(container: Any) -> dict[str, Any]:
    """The tokenizer files an open container's manifest lists, name -> {"bytes", "crc32c"} ({} for
    a container converted from a checkpoint without a tokenizer)."""
    source = container.manifest.get("source")
    listed = source.get("tokenizer") if isinstance(source, dict) else None
    if not listed:
        return {}
    if not isinstance(listed, dict) or TIKTOKEN_FILE not in listed:
        raise WasteError(f"{container.path / 'manifest.json'}: source.tokenizer does not list {TIKTOKEN_FILE}")
    return {name: record for name, record in listed.items() if name in TOKENIZER_FILES}


def tokenizer_problems(container: Any) -> list[str]:
    """What is wrong with the tokenizer files an open container's manifest lists (missing, damaged),
    one line each; `waste verify` reports them with the data files' problems."""
    problems = []
    for name, record in listed_tokenizer_files(container).items():
        try:
            container.read_side_file(f"{CONTAINER_DIR}/{name}", record)
        except WasteError as e:
            problems.append(str(e))
    return problems


def require_tokenizer(container: Any) -> Tokenizer:
    """The container's tokenizer (an open Container or a path), or one line saying it has none."""
    tok = container_tokenizer(container)
    if tok is None:
        where = getattr(container, "path", container)
        raise WasteError(f"{where} has no tokenizer (the checkpoint it was converted from had no tiktoken.model); "
                         f"give token ids with --prompt-ids")
    return tok


def tokenizer_file_bytes(hf_dir: str | Path) -> dict[str, bytes]:
    """The tokenizer files of a checkpoint directory ({} when it has no tiktoken.model), checked to load."""
    hf_dir = Path(hf_dir)
    if not has_tokenizer(hf_dir):
        return {}
    files = {name: (hf_dir / name).read_bytes() for name in TOKENIZER_FILES if (hf_dir / name).is_file()}
    tokenizer_from_files(files, hf_dir)
    return files


def file_record(files: dict[str, bytes]) -> dict[str, dict[str, int]]:
    """Bytes and CRC32C of each file, as the container manifest lists them under source.tokenizer."""
    from waste.container.format import side_file_record

    return {name: side_file_record(data) for name, data in files.items()}


def _pieces(text: str) -> Iterator[bytes]:
    import regex

    for m in regex.finditer(PAT_STR, text, flags=regex.V1):
        yield m.group().encode()


def train_bpe(text: str, num_tokens: int) -> list[bytes]:
    """`num_tokens` mergeable tokens, in rank order: the 256 bytes, merges learned from `text`
    (most frequent pair first, within Kimi's pre-split pieces), then unused byte pairs and triples."""
    if num_tokens < 256:
        raise WasteError(f"a byte-level vocabulary needs at least 256 tokens, got {num_tokens}")
    tokens = [bytes([b]) for b in range(256)]
    known = set(tokens)
    words = Counter(tuple(bytes([b]) for b in piece) for piece in _pieces(text))
    while len(tokens) < num_tokens:
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:], strict=False):
                pairs[pair] += count
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]), default=None)
        if best is None or best[1] < 2:
            break
        a, b = best[0]
        tokens.append(a + b)
        known.add(a + b)
        merged: Counter[tuple[bytes, ...]] = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    # Fill up with byte pairs (printable ASCII first), then printable triples once every pair is a
    # token: each filler is one merge of two tokens that exist before it.
    order = list(range(32, 127)) + [b for b in range(256) if not 32 <= b < 127]
    fill = itertools.chain((bytes([x, y]) for x in order for y in order),
                           (bytes([x, y, z]) for x in order[:95] for y in order[:95] for z in order[:95]))
    while len(tokens) < num_tokens:
        pair = next(fill)
        if pair not in known:
            tokens.append(pair)
            known.add(pair)
    return tokens


def synthetic_tokenizer_files(cfg: ModelConfig) -> dict[str, bytes] | None:
    """tiktoken.model and tokenizer_config.json for a config, or None when its vocabulary cannot hold
    256 bytes and 256 special tokens, or its bos/eos/pad ids are not where Kimi puts them."""
    n = cfg.vocab_size - NUM_RESERVED_SPECIAL
    wanted = {"bos_token_id": n + BOS_OFFSET, "eos_token_id": n + EOS_OFFSET, "pad_token_id": n + PAD_OFFSET}
    if n < 256 or any(getattr(cfg, k) not in (None, v) for k, v in wanted.items()):
        return None
    tokens = train_bpe(_TRAINING_TEXT, n)
    model = b"".join(base64.b64encode(t) + b" %d\n" % r for r, t in enumerate(tokens))
    added = {str(n + off): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False, "special": True} for off, name in KIMI_SPECIALS.items()}
    config = {"added_tokens_decoder": added, "bos_token": KIMI_SPECIALS[BOS_OFFSET],
              "eos_token": KIMI_SPECIALS[EOS_OFFSET], "pad_token": KIMI_SPECIALS[PAD_OFFSET],
              "unk_token": KIMI_SPECIALS[254], "additional_special_tokens": [
                  KIMI_SPECIALS[i] for i in (2, 3, 4, 6, 7, 9, 10, 17)],
              "chat_template": CHAT_TEMPLATE, "model_max_length": cfg.max_position_embeddings,
              "tokenizer_class": "TikTokenTokenizer",
              "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}
    return {TIKTOKEN_FILE: model, CONFIG_FILE: (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode()}


def write_files(directory: str | Path, files: dict[str, bytes]) -> None:
    """Write each file under `directory` through a temporary name and a rename."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        write_atomic(directory / name, lambda f, data=data: f.write(data))
