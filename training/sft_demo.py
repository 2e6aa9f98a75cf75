"""The `sft-lora` starter's data: a tiny chat-template tokenizer and a synthetic instruction
set per site, prepared into token shards as a site would (`xffl data prepare`).

The tokenizer is a word-level one (tokenizers' WordLevel, split at whitespace) over a
made-up lexicon, with a chat template in the style of Zephyr's (``<|user|>``, ``<|assistant|>``
and ``</s>`` ending each turn). Each site's examples are one task over random words, a pure
function of the site's name: alpha reverses the words of the input, beta copies them and
ends with their count's word. JSON lines in the instruction format (instruction, input,
output), rendered by the template, the loss on the responses only.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from xffl.core.errors import InvalidInput

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
WORDS = [a + b for a in ("ba", "ko", "mi", "tu", "se", "ra", "lo", "ne") for b in
         ("n", "l", "k", "s", "t", "p")]  # 48 made-up words
NUMBERS = ["one", "two", "three", "four", "five", "six"]
INSTRUCTIONS = {"alpha": "reverse the words", "beta": "copy the words and count them"}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
VOCABULARY = [*SPECIALS, *WORDS, *NUMBERS, *sorted({w for t in INSTRUCTIONS.values()
                                                  for w in t.split()})]


def write_tokenizer(folder: Path) -> Path:
    """Save the tiny chat tokenizer (tokenizer.json, its config and template) in ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCABULARY)},
                                         unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",  # type: ignore[no-untyped-call]
                                  unk_token="<unk>", pad_token="<pad>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(folder))
    return folder


def examples(site: str, count: int) -> list[dict[str, str]]:
    """``count`` instruction examples of the site's task (a pure function of its name)."""
    if site not in INSTRUCTIONS:
        raise InvalidInput(f"no synthetic instruction task {site!r}; known: "
                           f"{', '.join(INSTRUCTIONS)}")
    rng = random.Random(int.from_bytes(hashlib.sha256(f"xffl-sft:{site}".encode())
                                       .digest()[:8], "big"))
    out = []
    for _ in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 6))]
        answer = words[::-1] if site == "alpha" else [*words, NUMBERS[len(words) - 1]]
        out.append({"instruction": INSTRUCTIONS[site], "input": " ".join(words),
                    "output": " ".join(answer)})
    return out


SEQ_LEN = 32  # the sft-lora job's training.seq_len: the longest example is 25 tokens
SITES = {"alpha": 400, "beta": 300}  # examples per site


def write_site(data: Path, tokenizer: Path, site: str, count: int,
               validation_fraction: float = 0.1) -> Path:
    """The site's examples as DATA/SITE.jsonl, prepared (padded to SEQ_LEN + 1 tokens) into
    token shards in DATA/SITE."""
    from xffl.training.prepare_examples import Options, prepare_examples

    data.mkdir(parents=True, exist_ok=True)
    source = data / f"{site}.jsonl"
    source.write_text("".join(json.dumps(e) + "\n" for e in examples(site, count)))
    prepare_examples([source], data / site, tokenizer, None,
                     Options(fmt="instruction", seq_len=SEQ_LEN,
                              validation_fraction=validation_fraction))
    return data / site


def write_demo(folder: Path) -> list[Path]:
    """The sft-lora starter's tokenizer and sites' data under ``folder``; the paths written."""
    data = folder / "data"
    tokenizer = write_tokenizer(data / "tokenizer")
    written = [tokenizer]
    for site, count in SITES.items():
        written += [data / f"{site}.jsonl", write_site(data, tokenizer, site, count)]
    return written
