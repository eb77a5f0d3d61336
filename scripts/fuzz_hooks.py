"""Schemathesis hooks for scripts/fuzz: hostile text that the schema alone never generates.

The OpenAPI document describes well-formed requests; the inputs that once did lasting harm
were well-formed JSON with unstorable or ambiguous content. So besides what schemathesis
draws from the schema, every request part may carry:

- a NUL character inside any string (Postgres `text` and `jsonb` cannot store it),
- a leap second (`:60`) in any string that looks like an RFC 3339 timestamp (chrono parses
  it, Postgres rolls it into the next minute, so the hashed and stored texts would differ),
- a duplicated key in a JSON object body, the second value different from the first (a
  parser that keeps the last value would let `{"scopes": [...], "scopes": [...]}` through).

Which one a request carries follows from the value Hypothesis drew, so a run replays with its seed. The
service must answer each with a 4xx that its OpenAPI document lists, never a 5xx.
"""

import datetime
import json
import re
import uuid
import zlib

import schemathesis

# An RFC 3339 date-time; its seconds field is what the leap-second mutation replaces.
TIMESTAMP = re.compile(r"^(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:)\d{2}((\.\d+)?(Z|[+-]\d{2}:\d{2}))$")
# What a timestamp field becomes under the leap-second mutation: the last minute of
# yesterday (UTC), so that an event carrying it is inside the backdate window and, but for
# the leap second, would be stored.
_YESTERDAY = (datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=1)).date().isoformat()
LEAP_SECONDS = [f"{_YESTERDAY}T23:59:60Z", f"{_YESTERDAY}T23:59:60.500Z", f"{_YESTERDAY}T23:59:60.000+00:00"]
# The mutations of a string, and the plain value kept as it was drawn.
KEEP, NUL, LEAP = "keep", "nul", "leap"


def mutate_string(value, how):
    if how == NUL:
        middle = len(value) // 2
        return value[:middle] + "\u0000" + value[middle:]
    if how == LEAP:
        match = TIMESTAMP.match(value)
        if match:
            return f"{match.group(1)}60{match.group(2)}"
    return value


def mutate(value, how, keys):
    """The same structure with every string mutated one way (and object keys, for NUL in a
    body; a parameter's name must stay, or the request no longer names the parameter)."""
    if isinstance(value, str):
        return mutate_string(value, how)
    if isinstance(value, list):
        return [mutate(item, how, True) for item in value]
    if isinstance(value, dict):
        return {
            mutate_string(key, how) if how == NUL and keys else key: mutate(item, how, True)
            for key, item in value.items()
        }
    return value


def with_leap_timestamps(value):
    """A timestamp-shaped field with no timestamp in it still gets a leap second."""
    if isinstance(value, dict):
        return {
            key: (LEAP_SECONDS[len(key) % len(LEAP_SECONDS)] if key in ("occurred_at", "time", "as_of") else with_leap_timestamps(item))
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [with_leap_timestamps(item) for item in value]
    return value


def choose(value):
    """The mutation for a drawn value, decided by its own text: a replay with the run's seed
    draws the same value and so sends the same bytes. (Drawing the choice from a strategy of
    its own deepened the stack enough to hit a CPython 3.11 ast bug inside Hypothesis.)"""
    text = json.dumps(value, sort_keys=True, default=str).encode()
    return [KEEP, KEEP, NUL, LEAP][zlib.crc32(text) % 4]


def hostile(value, timestamps, keys):
    how = choose(value)
    if value is None or how == KEEP:
        return value
    value = mutate(value, how, keys)
    return with_leap_timestamps(value) if how == LEAP and timestamps else value


def strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from strings(item)


def storable_event(body):
    """An event the service would store, carrying the drawn body's first string as its name.

    Events drawn from the schema alone are almost never stored (a random `occurred_at` is
    outside the backdate window), so no hostile text would reach the ledger. This keeps
    Hypothesis's strings and puts them where they are stored, hashed and read back."""
    text = json.dumps(body, sort_keys=True, default=str)
    name = next(strings(body), "fuzz")[:128]
    now = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=1)
    return {
        "id": str(uuid.uuid5(uuid.NAMESPACE_URL, text)),
        "type": "container.created",
        "org_id": "org_fuzz",
        "container_id": f"ctr_{zlib.crc32(text.encode()) % 1000}",
        "occurred_at": now.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "data": {"name": name},
    }


@schemathesis.hook
def map_body(context, body):
    operation = context.operation
    if operation is not None and operation.method.upper() == "POST" and operation.path == "/v1/events":
        if zlib.crc32(json.dumps(body, sort_keys=True, default=str).encode()) % 2 == 0:
            body = storable_event(body)
    return hostile(body, timestamps=True, keys=True)


def reachable(parameters, name):
    """A `min_position` past the ledger head is answered, as documented, 503
    `projection_lagging` once the read wait is over; the fuzz cannot know the head, so a
    whole number from 0 becomes 0. A negative or non-numeric one stays, for its 422."""
    if not parameters:
        return parameters
    for key in list(parameters):
        if key.lower() == name.lower():
            try:
                if int(str(parameters[key])) >= 0:
                    parameters[key] = 0 if not isinstance(parameters[key], str) else "0"
            except ValueError:
                pass
    return parameters


@schemathesis.hook
def map_query(context, query):
    return hostile(reachable(query, "min_position"), timestamps=True, keys=False)


@schemathesis.hook
def map_headers(context, headers):
    return reachable(headers, "Tally-Min-Position")


@schemathesis.hook
def map_path_parameters(context, path_parameters):
    return hostile(path_parameters, timestamps=False, keys=False)


def duplicate_first_key(value):
    """JSON text of `value` with its first key written twice, the first time with another value."""
    key = next(iter(value))
    decoy = [] if not isinstance(value[key], list) else {}
    rest = json.dumps(value)[1:]
    return ("{" + json.dumps(key) + ":" + json.dumps(decoy) + "," + rest).encode()


@schemathesis.serializer("application/json")
def json_with_duplicate_keys(context, value):
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    # One body in four (decided by its own text, so a replay sends the same bytes).
    text = json.dumps(value)
    if isinstance(value, dict) and value and sum(text.encode()) % 4 == 0:
        return duplicate_first_key(value)
    return text.encode()
