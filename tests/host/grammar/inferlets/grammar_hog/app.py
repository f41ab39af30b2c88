"""A test inferlet that takes grammar resources as a hostile tenant would: args[0] names what it
does, and it reports by `send` what it got before a limit stopped it."""

import json

from inferlet import Grammar, GrammarError, emit, send

KEPT: list = []  # module global: nothing is dropped by garbage collection before the run ends


def history(args):
    """args[1] accepted tokens, then args[2] forks of that matcher, all kept."""
    matcher = Grammar.regex("a*").matcher()
    KEPT.append(matcher)
    for i in range(int(args[1])):
        matcher.accept(97)
        if i % 1000 == 0:
            send(json.dumps({"accepted": i}))
    for i in range(int(args[2])):
        KEPT.append(matcher.fork())
        send(json.dumps({"forks": i + 1}))


def resets(args):
    """args[1] rounds of args[2] tokens, each round on a matcher that was reset (its history is
    gone, not its memory), then one round more on a fresh matcher."""
    matcher = Grammar.regex("a*").matcher()
    for _ in range(int(args[1])):
        for _ in range(int(args[2])):
            matcher.accept(97)
        matcher.reset()
    send(json.dumps({"rounds": int(args[1])}))
    fresh = Grammar.regex("a*").matcher()
    for _ in range(int(args[2])):
        fresh.accept(97)
    send(json.dumps({"fresh": int(args[2])}))


def churn(args):
    """args[1] matchers of args[2] tokens each, each released before the next."""
    grammar = Grammar.regex("a*")
    for _ in range(int(args[1])):
        matcher = grammar.matcher()
        for _ in range(int(args[2])):
            matcher.accept(97)
        matcher.release()
    send(json.dumps({"matchers": int(args[1])}))


def matchers(args):
    grammar = Grammar.regex("a*")
    for i in range(int(args[1])):
        KEPT.append(grammar.matcher())
        if i % 10 == 9:
            send(json.dumps({"matchers": i + 1}))


def grammars(args):
    for i in range(int(args[1])):
        try:
            KEPT.append(Grammar.regex(f"a{{{i}}}"))
        except GrammarError as exc:
            send(json.dumps({"grammars": i, "error": str(exc)}))
            return
    send(json.dumps({"grammars": int(args[1])}))


def transient(args):
    """args[1] grammars, each with a matcher, none kept: dropped as the guest lets them go."""
    for i in range(int(args[1])):
        Grammar.regex(f"b{{{i}}}").matcher().accept(98)
    send(json.dumps({"grammars": int(args[1])}))


def leak(args):
    """args[1] matchers with args[2] tokens each and a fork each, kept; the run then ends."""
    grammar = Grammar.regex("a*")
    for _ in range(int(args[1])):
        matcher = grammar.matcher()
        for _ in range(int(args[2])):
            matcher.accept(97)
        KEPT.append(matcher)
        KEPT.append(matcher.fork())
    emit("kept")


def main(args: list[str]) -> None:
    globals()[args[0]](args)
