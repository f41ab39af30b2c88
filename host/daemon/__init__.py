"""`wafer serve`: the host as an HTTP daemon (OpenAI-compatible API, inferlet runs, operations).

It owns the HTTP edge, the driver's supervision and the runs started over HTTP; generation itself
is done by inferlets in the sandbox, never here.
"""
