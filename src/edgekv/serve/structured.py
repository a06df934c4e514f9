"""`response_format`: the answer as JSON, sampled under a grammar (OpenAI's structured outputs).

`json_object` is any JSON object; `json_schema` is the JSON its schema accepts, converted to a
GBNF grammar by llama-cpp-python's converter (`engines.constraint.json_schema_grammar`) and
sampled under llama.cpp's grammar sampler. The schema is enforced whether or not `strict` is
set (at OpenAI `strict: false` only asks the model to follow it; here following it costs
nothing more). A schema the converter cannot take (an unknown type, a `$ref` that resolves
nowhere, a `pattern` without `^...$`) is a 400 that quotes the converter; the grammar is built
over the vocabulary when the request arrives, so an engine without grammar sampling refuses
the request before it waits in the queue. An answer cut by `max_tokens` ends mid-JSON, with
finish_reason "length", as at OpenAI.
"""

from __future__ import annotations

from ..engines.constraint import Grammar, json_object_grammar, json_schema_grammar
from ..errors import ConfigError
from .errors import APIError
from .schemas import JSONObjectFormat, JSONSchemaFormat, TextFormat

__all__ = ["response_grammar"]


def response_grammar(fmt: TextFormat | JSONObjectFormat | JSONSchemaFormat | None
                     ) -> Grammar | None:
    """The grammar a `response_format` asks for (None: free text); a 400 for a bad schema."""
    if fmt is None or isinstance(fmt, TextFormat):
        return None
    if isinstance(fmt, JSONObjectFormat):
        return json_object_grammar()
    schema = fmt.json_schema.schema_
    if schema is None:
        return json_object_grammar()
    try:
        return json_schema_grammar(schema)
    except ConfigError as e:
        raise APIError(400, f"response_format.json_schema.schema ({fmt.json_schema.name!r}): "
                       f"{e}; send a JSON schema of supported keywords (type, properties, "
                       "required, items, enum, const, anyOf, $ref to $defs, ...)",
                       code="invalid_schema", param="response_format") from None
