"""What a pause costs the work that follows it, on this machine: one unit of Python work (an episode step's
kind: decode an LLM answer, extend the conversation, encode the next request) timed with the thread's own CPU
clock, back to back and after sleeps of growing length.

A second table runs N slots that each step after a 2,000 ms pause, spread evenly, as N threads and as one
thread taking the N in turn (what an event loop would do). The factor it prints is why a figure measured at
0 ms LLM latency understates what the same rollout costs at 2 s. Why and figures: docs/performance.md, "The
same work costs more after a pause".

    python -m bridge_lab.bench.wake_cost            # about 2 minutes
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Sequence

_ANSWER = json.dumps(
    {
        "id": "chatcmpl-0",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "search[blue wireless headphones]"}}],
        "usage": {"prompt_tokens": 900, "completion_tokens": 12},
        "prompt_token_ids": list(range(30_000, 30_900)),
    }
)
_OBSERVATION = "Back to Search [SEP] Page 1 (Total results: 50) [SEP] Next > " * 20


def one_step(conversation: list[dict[str, str]]) -> int:
    """Decode an answer, append it and an observation, encode the next request: about 1-2 ms of CPU."""
    answer = json.loads(_ANSWER)
    conversation.append(answer["choices"][0]["message"])
    conversation.append({"role": "user", "content": _OBSERVATION})
    del conversation[1:-8]  # a bounded history, as the agent keeps
    return len(json.dumps({"model": "m", "messages": conversation, "ids": answer["prompt_token_ids"]}))


def _conversation() -> list[dict[str, str]]:
    """A fresh conversation, its code path warmed by one untimed step."""
    conversation = [{"role": "system", "content": "You are shopping."}]
    one_step(conversation)
    return conversation


def _step_after(pause_s: float, conversation: list[dict[str, str]]) -> float:
    """Sleep ``pause_s``, then one step: the CPU seconds the step took on this thread's clock."""
    if pause_s:
        time.sleep(pause_s)
    started = time.thread_time()
    one_step(conversation)
    return time.thread_time() - started


def cpu_per_step_us(pause_s: float, steps: int) -> float:
    conversation = _conversation()
    return sum(_step_after(pause_s, conversation) for _ in range(steps)) / steps * 1e6


def threads_cpu_per_step_us(threads: int, pause_s: float, wall_s: float) -> float:
    """``threads`` threads, each stepping its own conversation after every ``pause_s``, started evenly
    spread over one pause: how a ``-P threads -c N`` worker's slots meet their LLM answers."""
    spent: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + wall_s

    def slot(index: int) -> None:
        conversation = _conversation()
        time.sleep(pause_s * index / threads)
        mine: list[float] = []
        while time.monotonic() < stop:
            mine.append(_step_after(pause_s, conversation))
        with lock:
            spent.extend(mine)

    workers = [threading.Thread(target=slot, args=(index,)) for index in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(spent) / max(1, len(spent)) * 1e6


def loop_cpu_per_step_us(conversations: int, pause_s: float, wall_s: float) -> float:
    """One thread stepping ``conversations`` in turn, one every ``pause_s / conversations``: the same answers
    met by an event loop instead of a thread per slot."""
    history = [_conversation() for _ in range(conversations)]
    spent, steps, stop = 0.0, 0, time.monotonic() + wall_s
    while time.monotonic() < stop:
        spent += _step_after(pause_s / conversations, history[steps % conversations])
        steps += 1
    return spent / max(1, steps) * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bridge_lab.bench.wake_cost",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--pauses-ms", default="0,1,10,100,500,2000", help="sleeps before each step, comma-separated")
    parser.add_argument("--budget-s", type=float, default=6.0, help="wall time to spend per pause (default 6)")
    parser.add_argument("--threads", default="1,8,128", help="thread counts for the second table (default 1,8,128)")
    parser.add_argument(
        "--threads-pause-ms", type=float, default=2000.0, help="each thread's pause in the second table (default 2000)"
    )
    args = parser.parse_args(argv)
    pauses = sorted({0.0, *(float(value) / 1000 for value in args.pauses_ms.split(","))})  # 0: the baseline
    print(f"{'pause before a step':>20}  {'CPU us per step':>15}  {'x back to back':>14}")
    baseline = 0.0
    for pause in pauses:
        steps = max(5, min(5_000, int(args.budget_s / (pause + 0.002))))
        cost = cpu_per_step_us(pause, steps)
        baseline = baseline or cost
        print(f"{pause * 1000:>17.0f} ms  {cost:>15.0f}  {cost / baseline:>14.2f}")
    pause = args.threads_pause_ms / 1000
    heading = f"slots, each {args.threads_pause_ms:,.0f} ms apart"
    print(f"\n{heading:>28}  {'CPU us per step':>15}  {'x back to back':>14}")
    wall = max(3 * pause, args.budget_s * 2)
    for count in (int(value) for value in args.threads.split(",")):
        cost = threads_cpu_per_step_us(count, pause, wall)
        print(f"{f'{count} thread' + 's' * (count > 1):>28}  {cost:>15.0f}  {cost / baseline:>14.2f}")
        if count > 1:
            cost = loop_cpu_per_step_us(count, pause, wall)
            print(f"{f'1 thread, {count} in turn':>28}  {cost:>15.0f}  {cost / baseline:>14.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
