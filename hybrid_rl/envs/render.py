"""Exact token continuity across turns: an observation becomes the chat template's own tokens, encoded once.

A trajectory is one token sequence: the prompt, then each model turn's ids as the engine sampled them, then the
tokens the chat template puts between the end of that turn and the start of the next, and so on. Those in-between
tokens (the end of the model's message, the observation's message, the next generation prompt) come from rendering
the conversation as text twice, with and without the new messages, and taking the difference: ``head`` is the
conversation so far with the generation prompt (the trajectory's text up to this turn), ``after`` the same plus the
model's turn (its decoded text) as an assistant message and one message per observation, again with the generation
prompt. ``after`` must start with ``head`` and then the turn's text (a template that trims messages, such as
Llama 3's, may drop the turn's outer whitespace); the rest is the glue: the template's end of the model's message,
the observations' messages and the next generation prompt (or, for a template that writes results inline in the
assistant's message, just the result). Less an EOS the model sampled itself, it is encoded once with
``add_special_tokens=False`` and appended; the turn's own ids are never decoded and encoded again, and ``after`` is
the next turn's ``head``, so the trajectory's text is always the template's rendering of its conversation. A
template that rewrites what came before (Qwen3's, which drops earlier ``<think>`` blocks) fails the check at its
first turn: a one-line ``TemplateError`` naming the tokenizer, at start-up when ``probe`` finds it. Left out: templates
that need the turn as structured ``tool_calls`` rather than text (the raw text is what the model wrote), and
starting a new training sample where a template is not append-only (prime-rl's way; here it is refused).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from hybrid_rl.config import ConfigError


class TemplateError(ConfigError):
    """The chat template cannot append an observation to the tokens so far; the message names the tokenizer."""


Message = Mapping[str, Any]


class TurnRenderer:
    """The glue tokens between a model turn and the next, for one tokenizer and its chat template.

    ``template_kwargs`` go to every render (``tools=...``); ``role`` is the observation messages' role;
    ``label`` names the tokenizer in errors (``model.path`` or ``model.tokenizer_path``)."""

    def __init__(self, tokenizer: Any, template_kwargs: Mapping[str, Any], role: str, label: str,
                 eos_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.kwargs = dict(template_kwargs)
        self.role = role
        self.label = label
        self.eos = set(int(i) for i in eos_token_ids)

    def render(self, messages: Sequence[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                  add_generation_prompt=generation_prompt, **self.kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def turn_text(self, sampled: Sequence[int]) -> str:
        """The turn as text (special tokens kept, a final EOS left out): what an environment reads."""
        body = list(sampled[:-1]) if sampled and int(sampled[-1]) in self.eos else list(sampled)
        return self.tokenizer.decode(body, skip_special_tokens=False)

    def glue(self, messages: Sequence[Message], sampled: Sequence[int],
             observations: Sequence[str]) -> tuple[list[int], list[dict]]:
        """The tokens to append after a turn's ``sampled`` ids for ``observations`` (the conversation so far is
        ``messages``, ending with the prompt or the previous observations), and the conversation with both."""
        content = self.turn_text(sampled)
        head = self.render(messages, True)
        after_msgs = [*map(dict, messages), {"role": "assistant", "content": content},
                      *({"role": self.role, "content": o} for o in observations)]
        after = self.render(after_msgs, True)
        if not after.startswith(head):
            raise self._error(f"adding the model's turn and a {self.role!r} message changed the text before them")
        rest = after[len(head):]
        if rest.startswith(content):
            text = rest[len(content):]
        elif content.strip() and rest.startswith(content.strip()):  # a template that trims messages
            text = rest[len(content.strip()):]
        else:
            raise self._error("the model's turn is not rendered as it was written")
        if sampled and int(sampled[-1]) in self.eos:  # the model wrote the end of its message itself
            eos_text = self.tokenizer.decode([int(sampled[-1])], skip_special_tokens=False)
            if text.startswith(eos_text):
                text = text[len(eos_text):]
        return self.encode(text), after_msgs

    def probe(self, messages: Sequence[Message]) -> None:
        """Two turns of a made-up conversation after ``messages``: TemplateError now rather than mid-run."""
        turn = self.encode("1")
        _, msgs = self.glue(messages, turn, ["2"])
        self.glue(msgs, turn, ["3", "4"])

    def _error(self, what: str) -> TemplateError:
        return TemplateError(f"env: the chat template of {self.label} is not append-only ({what}), so an "
                             f"observation cannot be appended to the tokens sampled so far; multi-turn rollouts need "
                             f"a template that only appends: set model.tokenizer_path to a tokenizer whose template "
                             f"does, or env.name=null for single-turn rollouts")
