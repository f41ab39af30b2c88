"""agent_turns (a test inferlet): an agent's turns in one context. Generate token by token and
break at a newline (a staged next step is then never used), add the next prompt, and complete
the next turn on the host; args: the number of turns. Sends the turns' texts."""

import json

from inferlet import Context, detokenize, send

NEWLINE = 10


def main(args: list[str]) -> None:
    turns = []
    with Context() as ctx:
        ctx.fill("Q: capital?\n")
        for turn in range(int(args[0])):
            said = []
            for token in ctx.generate(max_tokens=32, stop=[]):
                if token == NEWLINE:
                    break  # the token is pending in the context; the fire after it is dropped
                said.append(token)
            turns.append(detokenize(said))
            ctx.fill(f"Q{turn}: and then?\n")
            done = ctx.complete(max_tokens=32, stop=[NEWLINE])
            turns.append(detokenize(done.tokens))
            ctx.fill([NEWLINE])
    send(json.dumps(turns))
