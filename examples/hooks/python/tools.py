"""tools: two tools this server owns and executes (Describe + CallTool).

  get_weather(city, unit?)  a deterministic fake forecast
  lookup_customer(id)       a customer record that contains an e-mail address
                            and a SECRET-... token, so the redactor has
                            something to mask in tool_result

hookwire normally validates the model's arguments against the schema before
calling (invalid ones become an invalid_tool_call event), but a tool must not
trust that: a tool_call hook may have rewritten them. Bad arguments produce an
is_error result, which the model reads and can correct.
"""

from __future__ import annotations

import json
import re
import zlib

from hookproto import common, pb
from hooklib import Feature

# `examples` are standard JSON Schema: models read them, and `hookwire hooks
# check` calls each tool with them (it cannot invent a string matching a
# `pattern`).
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "description": "City name, e.g. Paris",
                 "examples": ["Paris"]},
        "unit": {"type": "string", "enum": ["C", "F"], "description": "Temperature unit"},
    },
    "required": ["city"],
    "additionalProperties": False,
}

CUSTOMER_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^C-[0-9]{4}$", "description": "Customer id, e.g. C-1001",
               "examples": ["C-1001"]},
    },
    "required": ["id"],
    "additionalProperties": False,
}

# Fake data. The e-mail and the SECRET- token are what the redactor masks.
CUSTOMERS = {
    "C-1001": {"id": "C-1001", "name": "Ada Lovelace", "email": "ada@example.com",
               "plan": "pro", "api_token": "SECRET-7F3KQ9ZX"},
    "C-1002": {"id": "C-1002", "name": "Alan Turing", "email": "alan@example.org",
               "plan": "free", "api_token": "SECRET-2M8WD4PL"},
}

KNOWN_WEATHER = {"paris": ("sunny", 21), "london": ("rainy", 14), "tokyo": ("cloudy", 18)}
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "foggy"]

_TYPES = {"object": dict, "string": str, "boolean": bool, "array": list}


def schema_errors(schema: dict, value, where: str = "arguments") -> list[str]:
    """Check `value` against the small JSON Schema subset the tools use (type,
    properties, required, additionalProperties: false, enum, pattern,
    minLength). A real server would use the `jsonschema` package."""
    kind = schema.get("type")
    if kind == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "number":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = kind is None or isinstance(value, _TYPES[kind])
    if not ok:
        return [f"{where} must be of type {kind}"]
    errors = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where} must be one of {schema['enum']}")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            errors.append(f"{where} must not be empty")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{where} must match {schema['pattern']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        errors += [f"{where}.{k} is required" for k in schema.get("required", []) if k not in value]
        for key, item in value.items():
            if key in props:
                errors += schema_errors(props[key], item, f"{where}.{key}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{where}.{key} is not allowed")
    return errors


def get_weather(args: dict) -> str:
    city = args["city"]
    # Deterministic: the same city always gets the same weather.
    condition, temp_c = KNOWN_WEATHER.get(city.lower()) or (
        CONDITIONS[zlib.crc32(city.lower().encode()) % len(CONDITIONS)],
        5 + zlib.crc32(city.lower().encode()) % 25,
    )
    if args.get("unit") == "F":
        return f"{condition}, {round(temp_c * 9 / 5 + 32)}F in {city}"
    return f"{condition}, {temp_c}C in {city}"


def lookup_customer(args: dict) -> str:
    record = CUSTOMERS.get(args["id"])
    if record is None:
        raise LookupError(f"no customer with id {args['id']}")
    return json.dumps(record)


class Tools(Feature):
    name = "tools"
    # (function, description for the model, schema)
    TOOLS = {
        "get_weather": (get_weather, "Current weather for a city.", WEATHER_SCHEMA),
        "lookup_customer": (lookup_customer, "A customer's record by id.", CUSTOMER_SCHEMA),
    }

    def tools(self) -> list[common.ToolSpec]:
        return [
            common.ToolSpec(name=name, description=desc, parameters_json_schema=json.dumps(schema))
            for name, (_, desc, schema) in self.TOOLS.items()
        ]

    def owns(self, name: str) -> bool:
        return name in self.TOOLS

    async def call_tool(self, request: pb.CallToolRequest) -> pb.CallToolResponse:
        func, _, schema = self.TOOLS[request.call.name]
        try:
            args = json.loads(request.call.arguments_json or "{}")
        except json.JSONDecodeError as e:
            return pb.CallToolResponse(content=f"arguments are not valid JSON: {e}", is_error=True)
        errors = schema_errors(schema, args)
        if errors:
            return pb.CallToolResponse(content="invalid arguments: " + "; ".join(errors), is_error=True)
        try:
            return pb.CallToolResponse(content=func(args))
        except LookupError as e:
            return pb.CallToolResponse(content=str(e), is_error=True)
