"""JSON checks shared by the structured-output and tool-call tests: JSON Schema validation with
formats, and the compact layout the constraint promises."""
import jsonschema


def validate(instance, schema):
    """JSON Schema validation, `format` included (date, uuid)."""
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    cls(schema, format_checker=cls.FORMAT_CHECKER).validate(instance)


def assert_compact(text):
    """The layout the contract promises: no free whitespace. Outside strings, the only
    whitespace allowed is one space right after a `,` or a `:` (a fixed separator), never a
    newline, an indent, or a space anywhere else."""
    assert text == text.strip(), f"leading or trailing whitespace: {text!r}"
    in_string = escaped = False
    prev = ""
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch.isspace():
            assert ch == " " and prev in (",", ":"), f"free whitespace at {i}: {text!r}"
        prev = ch
