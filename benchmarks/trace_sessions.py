"""The sessions of the trace benchmark (:mod:`.trace`): what each trace sends, turn by turn.

Real traffic repeats itself across requests; these traces do, as an agent or a chat client would:

* ``edit-loop``: a file edited turn after turn; each turn's prompt holds the previous turn's output (the
  file as it now is) plus the next instruction.
* ``chat-regenerate``: a chat where the user presses "regenerate" (the same prompt again) and goes on with
  a follow-up that quotes the answer, regenerated once more.
* ``shared-doc``: several clients at once, each asking its own questions about one shared document.
* ``n4``: one prompt, four sampled choices at once (temperature 0.8, four seeds: ``n = 4`` as the server
  fans it out).
* ``free``: distinct prompts that share nothing (the control: the pool and the n-gram drafter must cost
  nothing where they cannot help; never the same prompt twice up to ``len(FREE)`` turns).

A trace is a function ``(turns, ask)``: ``ask(Step)`` sends the step's prompts together and returns their
texts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

__all__ = ["TRACES", "REPETITIVE", "Step", "SCALE", "chat", "requests_per_trace"]

DOC = """The Harbour Street Library opens at nine in the morning from Monday to Saturday and closes at six in the \
evening, except on Thursdays, when it stays open until eight. On Sundays it is closed. Members may borrow up to \
twelve items at a time: books for three weeks, films and music for one week. A loan can be renewed twice, online or \
at the desk, unless another member has reserved the item. Late returns cost twenty cents per day for books and fifty \
cents per day for films, up to a maximum of five euros per item. Children under fourteen pay no late fees. The \
reading room on the first floor is a quiet zone: phone calls are not allowed there, and laptops must be muted. \
Group study rooms on the second floor can be booked for up to three hours per day, at most one week in advance. \
Printing costs ten cents per black-and-white page and forty cents per colour page; scanning is free. The library \
offers free wireless access; the network name is HarbourLib and no password is needed. Every first Saturday of the \
month there is a book sale in the entrance hall, and every Wednesday afternoon at four a story hour for children \
aged four to eight. Lost membership cards can be replaced at the desk for two euros."""

CODE = '''def parse_order(line):
    """Parse one order line: id, customer, amount."""
    parts = line.strip().split(",")
    order_id = int(parts[0])
    customer = parts[1].strip()
    amount = float(parts[2])
    return order_id, customer, amount


def total_by_customer(lines):
    """Sum the amounts per customer."""
    totals = {}
    for line in lines:
        order_id, customer, amount = parse_order(line)
        totals[customer] = totals.get(customer, 0.0) + amount
    return totals


def largest_order(lines):
    """The order with the largest amount."""
    best = None
    for line in lines:
        order = parse_order(line)
        if best is None or order[2] > best[2]:
            best = order
    return best
'''

EDITS = ["Rename the function parse_order to read_order everywhere.",
         "Rename the variable amount to value everywhere.",
         "Add a type hint for the argument lines in every function: lines: list[str].",
         "Change the docstring of total_by_customer to say: Sum the values per customer."]

QUESTIONS = [["When does the library close on Thursdays?", "How long can I borrow a film?"],
             ["How much does a late book cost per day?", "Is printing in colour more expensive?"],
             ["Can I make phone calls in the reading room?", "When is the story hour?"]]

FREE = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain in a few sentences why the sky is blue.",
        "Describe a walk through a forest in autumn.",
        "Give three tips for learning to cook at home.",
        "What would a city on Mars need to grow its own food?",
        "Write a letter from a cat to the dog next door.",
        "Why do some birds migrate south in winter?",
        "Invent a board game for four players and explain its rules."]


def chat(user: str) -> str:
    return f"<start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n"


@dataclass
class Step:
    """One turn: the prompts sent together (each with its seed), greedy unless ``temp``."""
    prompts: list[str]
    seeds: list[int] = field(default_factory=list)
    temp: float = 0.0


#: fraction of the document / the file / the questions kept (``--scale``: small models with a short context)
SCALE = [1.0]


def _cut(text: str) -> str:
    return text if SCALE[0] >= 1.0 else text[: max(16, int(len(text) * SCALE[0]))]


def edit_loop(turns: int, ask: Callable[[Step], list[str]]) -> None:
    text = _cut(CODE)
    for i in range(turns):
        out = ask(Step([chat(f"Here is a Python file:\n\n{text}\n{EDITS[i % len(EDITS)]} Reply with the whole "
                             "file and nothing else.")]))
        text = out[0] or text


def chat_regenerate(turns: int, ask: Callable[[Step], list[str]]) -> None:
    history = ""
    qs = [_cut(q) for q in ("What are three good habits for sleeping well?", "Explain the second habit in more detail.",
                            "Summarise your advice in one paragraph.")]
    for i in range(max(1, turns - 1)):
        prompt = history + chat(qs[i % len(qs)])
        ask(Step([prompt]))
        out = ask(Step([prompt]))  # "regenerate"
        history = prompt + out[0] + "<end_of_turn>\n"


def shared_doc(turns: int, ask: Callable[[Step], list[str]]) -> None:
    for t in range(min(turns, 2)):
        ask(Step([chat(f"Read this notice:\n\n{_cut(DOC)}\n\nQuestion: {qs[t % len(qs)]}") for qs in QUESTIONS]))


def n4(turns: int, ask: Callable[[Step], list[str]]) -> None:
    for t in range(max(1, turns // 2)):
        ask(Step([chat(f"Write a short product description for a {['wooden', 'steel'][t % 2]} garden bench.")] * 4,
                 seeds=[11 + t * 4 + j for j in range(4)], temp=0.8))


def free(turns: int, ask: Callable[[Step], list[str]]) -> None:
    for i in range(turns):
        ask(Step([chat(FREE[i % len(FREE)])]))


TRACES: dict[str, Callable[[int, Callable[[Step], list[str]]], None]] = {
    "edit-loop": edit_loop, "chat-regenerate": chat_regenerate, "shared-doc": shared_doc, "n4": n4, "free": free}
#: the traces whose requests repeat each other (targets: x2.0 plain, x1.3 llama-server's best; ``free``: x0.97 plain)
REPETITIVE = ("edit-loop", "chat-regenerate", "shared-doc", "n4")


def requests_per_trace(trace: str, turns: int) -> int:
    """Requests a trace sends (for the runtime estimate).

    >>> [requests_per_trace(t, 4) for t in TRACES]
    [4, 6, 6, 8, 4]
    """
    return {"edit-loop": turns, "chat-regenerate": 2 * max(1, turns - 1), "shared-doc": len(QUESTIONS) * min(turns, 2),
            "n4": 4 * max(1, turns // 2), "free": turns}[trace]
