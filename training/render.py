"""An example as text segments, each in or out of the loss: the text, instruction and chat formats.

Chat and instruction examples are rendered by the tokenizer's own chat template
(``tokenizer.apply_chat_template(messages, tokenize=False)``) when it has one. An instruction
example is the conversation ``[{"role": "user", "content": PROMPT}, {"role": "assistant",
"content": RESPONSE}]``, PROMPT being the instruction, then a blank line and the input when
the input is not empty (Alpaca's). Without a template an instruction example is rendered as
Alpaca's prompt, ``"### Instruction:\\n{instruction}\\n\\n### Input:\\n{input}\\n\\n###
Response:\\n"`` (the input block left out when empty), followed by the response and the
tokenizer's end-of-sequence token (none for bytes); a chat example then cannot be rendered.

The response segments of a templated conversation are found by rendering its prefixes: the
assistant turn ``k`` spans from the end of ``messages[:k]`` rendered with the generation
prompt to the end of ``messages[:k + 1]`` (the turn's end-of-turn text included). Both must
be prefixes of the whole rendering, as they are for every template that renders a
conversation turn by turn; one that does not is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from xffl.core.errors import InvalidInput
from xffl.training.sources import BadExample

Format = Literal["text", "instruction", "chat"]
TrainOn = Literal["response", "prompt+response"]
Segment = tuple[str, bool]  # text, and whether its tokens are targets of the loss
ROLES = ("system", "user", "assistant", "tool")
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
ALPACA_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"


@dataclass(frozen=True)
class Fields:
    """Which fields of a record hold the text, the prompt, the response and the messages."""

    text: str = "text"
    instruction: str = "instruction"
    input: str = "input"
    response: str = "output"
    messages: str = "messages"


class Renderer:
    """Records of one format -> text segments, by a chat template (``template``: the
    transformers tokenizer that has it) or by xffl's plain rendering."""

    def __init__(self, fmt: Format, fields: Fields, train_on: TrainOn, template: Any | None,
                 eos_text: str) -> None:
        self.fmt, self.fields, self.train_on = fmt, fields, train_on
        self.template, self.eos_text = template, eos_text
        # what apply_chat_template(tokenize=False) renders with: the tokenizer's template and
        # its special tokens, by transformers' own renderer (called directly: half the
        # time of apply_chat_template, whose message normalization plain dicts do not need)
        self._source = None if template is None else template.get_chat_template()
        self._variables = {} if template is None else dict(template.special_tokens_map)

    def segments(self, src: str, where: str, record: dict[str, Any]) -> list[Segment]:
        """The example's segments, concatenated: its whole text (InvalidInput if malformed)."""
        if self.fmt == "text":
            return [(_string(src, where, record, self.fields.text) + self.eos_text, True)]
        if self.fmt == "instruction":
            instruction = _string(src, where, record, self.fields.instruction)
            given = record.get(self.fields.input)  # optional: missing or null is empty
            extra = "" if given is None else _string(src, where, record, self.fields.input)
            response = _string(src, where, record, self.fields.response)
            if self.template is None:
                form = ALPACA_PROMPT if extra else ALPACA_NO_INPUT
                prompt = form.format(instruction=instruction, input=extra)
                return self._mark([(prompt, False), (response + self.eos_text, True)])
            prompt = f"{instruction}\n\n{extra}" if extra else instruction
            messages = [{"role": "user", "content": prompt},
                        {"role": "assistant", "content": response}]
        else:
            messages = _messages(src, where, record, self.fields.messages)
            if self.template is None:
                raise InvalidInput(f"{src}: {where}: field {self.fields.messages!r}: the "
                                   "tokenizer has no chat template to render messages with; "
                                   "pass --tokenizer a model folder whose tokenizer has one.")
        return self._mark(self._chat(src, where, messages))

    def _mark(self, segments: list[Segment]) -> list[Segment]:
        if self.train_on == "prompt+response":
            return [(text, True) for text, _ in segments]
        return segments

    def _render(self, messages: list[dict[str, str]], generation: bool) -> str:
        if not messages or self._source is None:
            return ""
        from transformers.utils.chat_template_utils import render_jinja_template

        # it returns (the renderings, the generation spans), though typed as a str
        rendered: Any = render_jinja_template(conversations=[messages],
                                              chat_template=self._source,
                                              add_generation_prompt=generation,
                                              **self._variables)
        return str(rendered[0][0])

    def _chat(self, src: str, where: str, messages: list[dict[str, str]]) -> list[Segment]:
        """Segments of a conversation: each assistant turn in the loss, the rest out."""
        try:
            return self._turns(src, where, messages)
        except InvalidInput:
            raise
        except Exception as exc:  # the template's own raise_exception, or a jinja error
            raise BadExample(f"{src}: {where}: field {self.fields.messages!r}: the chat "
                             f"template refused the conversation ({exc}).") from exc

    def _turns(self, src: str, where: str, messages: list[dict[str, str]]) -> list[Segment]:
        full = self._render(messages, False)
        segments: list[Segment] = []
        done = 0
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self._render(messages[:k], True)
            last = k == len(messages) - 1  # its end is the whole rendering's
            end_text = full if last else self._render(messages[:k + 1], False)
            start = len(prompt)
            if not (full.startswith(prompt) and full.startswith(end_text)
                    and done <= start <= len(end_text)):
                raise BadExample(f"{src}: {where}: field {self.fields.messages!r}: the chat "
                                 "template does not render the conversation turn by turn "
                                 f"(message {k} changes what comes before it); use "
                                 "--train-on prompt+response or another template.")
            segments += [(full[done:start], False), (full[start:len(end_text)], True)]
            done = len(end_text)
        segments.append((full[done:], False))
        return [(text, supervised) for text, supervised in segments if text]


def _string(src: str, where: str, record: dict[str, Any], field: str) -> str:
    if field not in record:
        raise BadExample(f"{src}: {where}: field {field!r} is missing; name the field that "
                         "holds it (e.g. --response-field).")
    value = record[field]
    if not isinstance(value, str):
        raise BadExample(f"{src}: {where}: field {field!r} is {type(value).__name__}, not "
                         "a string.")
    return value


def _messages(src: str, where: str, record: dict[str, Any],
              field: str) -> list[dict[str, str]]:
    """The record's messages: a non-empty list of {role, content} with a known role."""
    value = record.get(field)
    if field not in record:
        raise BadExample(f"{src}: {where}: field {field!r} is missing; name the field that "
                         "holds the messages with --messages-field.")
    if not isinstance(value, list) or not value:
        raise BadExample(f"{src}: {where}: field {field!r} is not a non-empty list of "
                         "messages.")
    out: list[dict[str, str]] = []
    for i, message in enumerate(value):
        name = f"{field}[{i}]"
        if not isinstance(message, dict):
            raise BadExample(f"{src}: {where}: field {name!r} is not an object with role "
                             "and content.")
        role = _string(src, where, message, "role") if "role" in message else None
        if role not in ROLES:
            raise BadExample(f"{src}: {where}: field {name + '.role'!r}: unknown role "
                             f"{role!r}; use one of {', '.join(ROLES)}.")
        if not isinstance(message.get("content"), str):
            raise BadExample(f"{src}: {where}: field {name + '.content'!r} is missing or "
                             "not a string.")
        out.append({"role": role, "content": message["content"]})
    if all(m["role"] != "assistant" for m in out):
        raise BadExample(f"{src}: {where}: field {field!r} has no assistant message: "
                         "nothing to learn from it.")
    return out
