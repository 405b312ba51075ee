"""What the agent tells the LLM, and how its answer becomes a WebShop action.

The prompt keeps the contract every OpenAI-compatible model can follow: a system message with the
action grammar and worked examples, then one user message per step carrying the observation, and the
model's previous answers as assistant messages. Only the latest observations are kept in full so a
15-step conversation stays within a small model's context.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

SYSTEM_PROMPT = """You are a careful online shopper operating the WebShop website through text.

Every turn you receive the page you are looking at. Page elements are separated by " [SEP] ".
You act by writing exactly one action on the last line of your reply, in one of two forms:

Action: search[<keywords>]      type keywords into the search box (works from any page)
Action: click[<element>]        click a button, a product id, or an option value shown on the page

Useful elements: "Back to Search", "Next >", "< Prev", a product id such as B07XYZ1234, option values
such as "large" or "navy blue", "Description", "Features", "Reviews", and "Buy Now".

How to shop well:
1. Search with the key product words from the instruction.
2. Open the result that best matches the requested product and price limit.
3. On the product page click every option value the instruction asks for (size, colour, ...).
4. Click "Buy Now" to finish. Nothing else ends the task.

Examples:
Action: search[wireless bluetooth headphones blue]
Action: click[B09QKP7XQL]
Action: click[blue]
Action: click[Buy Now]

Write real keywords and real element names: never "search[query]" or "click[element]".
You may write one short line of reasoning starting with "Thought:" before the action."""

_ACTION = re.compile(r"\b(search|click)\s*\[([^\[\]\n]*)\]", re.IGNORECASE)
_PLACEHOLDERS = {"query", "keywords", "element", "...", "…", "<keywords>", "<element>", "item", "product", "asin"}
_MIN_QUERY_CHARS = 3
_KEEP_FULL_OBSERVATIONS = 2
_OLD_OBSERVATION_CHARS = 400


@dataclass(frozen=True)
class ParsedAction:
    action: str | None  # canonical "search[...]" / "click[...]", or None when rejected
    problem: str | None = None  # feedback for a re-prompt


def parse_action(text: str) -> ParsedAction:
    """Take the last well-formed action in the reply; reject placeholders and empty or tiny queries."""
    matches = _ACTION.findall(text or "")
    if not matches:
        if re.search(r"\bbuy\s+now\b", text or "", re.IGNORECASE):
            return ParsedAction("click[Buy Now]")
        return ParsedAction(
            None, "I could not find an action. End your reply with e.g. 'Action: search[red cotton shirt]'."
        )
    verb, argument = matches[-1]
    verb, argument = verb.lower(), argument.strip()
    if argument.lower() in _PLACEHOLDERS or set(argument) <= {".", "…", " "}:
        return ParsedAction(
            None, f"'{verb}[{argument}]' is a placeholder. Use real words from the page or the instruction."
        )
    if verb == "search" and len(argument) < _MIN_QUERY_CHARS:
        return ParsedAction(None, f"The search query '{argument}' is too short. Search with descriptive product words.")
    if verb == "click" and not argument:
        return ParsedAction(None, "click[] needs the name of an element shown on the page.")
    return ParsedAction(f"{verb}[{argument}]")


def step_prompt(step: int, max_steps: int, observation: str, clickables: list[str] | None) -> str:
    lines = [f"Step {step} of {max_steps}.", f"Observation: {observation}"]
    if clickables:
        lines.append("Clickable: " + ", ".join(clickables[:60]))
    if step == max_steps:
        lines.append("This is your last step: click Buy Now now if you are on a product page.")
    return "\n".join(lines)


class Conversation:
    """The message list sent to the LLM, with old observations shortened."""

    def __init__(self) -> None:
        self.messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM_PROMPT}]

    def observe(self, text: str) -> None:
        self._shorten_old_observations()
        self.messages.append({"role": "user", "content": text})

    def answer(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})

    def feedback(self, text: str) -> None:
        self.messages.append({"role": "user", "content": f"Invalid action: {text}"})

    def _shorten_old_observations(self) -> None:
        users = [m for m in self.messages if m["role"] == "user" and not m["content"].startswith("Invalid action")]
        for message in users[: max(0, len(users) - _KEEP_FULL_OBSERVATIONS + 1)]:
            if len(message["content"]) > _OLD_OBSERVATION_CHARS:
                message["content"] = message["content"][:_OLD_OBSERVATION_CHARS] + " ..."


def choose_action(
    conversation: Conversation, ask: Callable[[], str], reprompts: int, before_each: Callable[[], object] | None = None
) -> str | None:
    """Ask (``ask`` sends ``conversation`` to the LLM) until an answer parses as an action, re-prompting with
    feedback at most ``reprompts`` times; None when none did. ``before_each`` runs before every ask."""
    for _ in range(reprompts + 1):
        if before_each is not None:
            before_each()
        reply = ask()
        conversation.answer(reply)
        parsed = parse_action(reply)
        if parsed.action is not None:
            return parsed.action
        conversation.feedback(parsed.problem or "invalid action")
    return None
