"""typos (a test inferlet): SDK calls with arguments of the wrong type; args[0] names the case.
Each raises TypeError at its line here."""

from inferlet import Context, Grammar, Random, emit, send


def emit_int() -> None:
    emit(12345)


def send_dict() -> None:
    send({"answer": 42})


def fill_floats() -> None:
    Context().fill([65, 66.0])


def fill_int() -> None:
    Context().fill(65)


def random_str() -> None:
    Random(temperature="0.7")


def regex_int() -> None:
    Grammar.regex(123)


CASES = {f.__name__: f for f in (emit_int, send_dict, fill_floats, fill_int, random_str, regex_int)}


def main(args: list[str]) -> None:
    CASES[args[0]]()
