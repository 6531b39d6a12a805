"""The toolcalc toy world's tools: a safe calculator, a unit converter and a fixed lookup table.

Everything here is deterministic and invented (no world knowledge), so a task generator can
compute every answer by calling these same functions, and a student can only get a `lookup` fact
by calling the tool. Tools return short JSON objects {"result": number}; a bad request raises
ValueError, which the executor turns into the student's {"error": "..."} observation.
"""

import ast
import math
import operator

from opd.tool_schemas import Tool, ToolRegistry

SIGNIFICANT_DIGITS = 6
MAX_EXPRESSION_CHARS = 256
MAX_EXPONENT = 64
# Every intermediate stays below 2**53, so integers survive a round trip through a float.
MAX_MAGNITUDE = 1e15

LOOKUP_ATTRIBUTES = ("population", "height_m", "founded_year", "area_km2")
LOOKUP_TABLE: dict[str, dict[str, float | int]] = {
    "Veltrane": {"population": 19335, "height_m": 2984, "founded_year": 1712, "area_km2": 9.4},
    "Orsk Station": {"population": 744274, "height_m": 1681, "founded_year": 1895, "area_km2": 196.4},
    "Quillmere": {"population": 3219, "height_m": 1006, "founded_year": 1771, "area_km2": 398.3},
    "Darrowgate": {"population": 24748, "height_m": 1705, "founded_year": 1659, "area_km2": 213.2},
    "Pellinor Reach": {"population": 1446600, "height_m": 1269, "founded_year": 1676, "area_km2": 179.1},
    "Tessaly Ford": {"population": 29753, "height_m": 2997, "founded_year": 1912, "area_km2": 1581.0},
    "Brannock Hollow": {"population": 1924, "height_m": 3084, "founded_year": 1865, "area_km2": 31.6},
    "Ixmoor": {"population": 156434, "height_m": 2674, "founded_year": 1271, "area_km2": 50.3},
    "Caldrift": {"population": 625679, "height_m": 241, "founded_year": 1909, "area_km2": 13.1},
    "Vornhelm": {"population": 12105, "height_m": 510, "founded_year": 1862, "area_km2": 239.4},
    "Sablewick": {"population": 250427, "height_m": 1600, "founded_year": 1458, "area_km2": 12.7},
    "Mirrowend": {"population": 1838, "height_m": 1750, "founded_year": 1544, "area_km2": 10.3},
    "Kethra Bay": {"population": 2057, "height_m": 1668, "founded_year": 1354, "area_km2": 4.5},
    "Ulvenhold": {"population": 223693, "height_m": 3122, "founded_year": 1139, "area_km2": 1280.5},
    "Zarrowmede": {"population": 3046, "height_m": 2073, "founded_year": 1446, "area_km2": 296.3},
    "Thistlequay": {"population": 46413, "height_m": 2890, "founded_year": 1551, "area_km2": 92.0},
    "Norrowcliff": {"population": 5731, "height_m": 2675, "founded_year": 1741, "area_km2": 314.2},
    "Amberlash": {"population": 2495, "height_m": 1903, "founded_year": 1494, "area_km2": 2.7},
    "Fennick Cross": {"population": 7968, "height_m": 2441, "founded_year": 1976, "area_km2": 102.3},
    "Glimmerholt": {"population": 3128, "height_m": 2556, "founded_year": 1465, "area_km2": 11.8},
    "Hespering Vale": {"population": 155741, "height_m": 2921, "founded_year": 1596, "area_km2": 570.1},
    "Jorvane": {"population": 125742, "height_m": 3146, "founded_year": 1255, "area_km2": 11.5},
    "Korrigan Spur": {"population": 1933, "height_m": 2814, "founded_year": 1187, "area_km2": 2.1},
    "Lumenhythe": {"population": 507594, "height_m": 19, "founded_year": 1274, "area_km2": 25.2},
    "Marrowdeep": {"population": 2486, "height_m": 938, "founded_year": 1203, "area_km2": 4.2},
    "Nyssary Landing": {"population": 3802, "height_m": 2848, "founded_year": 1592, "area_km2": 84.2},
    "Pallowmere": {"population": 21467, "height_m": 1787, "founded_year": 1799, "area_km2": 1289.6},
    "Quorra Flats": {"population": 1834, "height_m": 292, "founded_year": 1428, "area_km2": 9.3},
    "Rivenmoor": {"population": 1037, "height_m": 2711, "founded_year": 1868, "area_km2": 6.3},
    "Skelloway": {"population": 762, "height_m": 897, "founded_year": 1320, "area_km2": 323.5},
    "Umberfall": {"population": 1476, "height_m": 916, "founded_year": 1447, "area_km2": 13.6},
    "Vexley Point": {"population": 147799, "height_m": 3277, "founded_year": 1166, "area_km2": 71.2},
    "Wyrmcombe": {"population": 1100848, "height_m": 2230, "founded_year": 1506, "area_km2": 990.0},
    "Yarrowtide": {"population": 172884, "height_m": 2596, "founded_year": 1195, "area_km2": 2.4},
    "Zeltaris": {"population": 515, "height_m": 515, "founded_year": 1969, "area_km2": 4.7},
    "Cobblemarsh": {"population": 81836, "height_m": 361, "founded_year": 1636, "area_km2": 3.6},
    "Drennic Outpost": {"population": 22625, "height_m": 3274, "founded_year": 1869, "area_km2": 3.4},
    "Emberly Sound": {"population": 675, "height_m": 2532, "founded_year": 1226, "area_km2": 394.9},
    "Frostkettle": {"population": 57259, "height_m": 3329, "founded_year": 1738, "area_km2": 104.9},
    "Gorravin Deep": {"population": 57871, "height_m": 2295, "founded_year": 1304, "area_km2": 55.2},
}

# Linear dimensions: factor from each unit to the dimension's SI unit (m, kg, s).
UNIT_FACTORS: dict[str, dict[str, float]] = {
    "length": {"m": 1.0, "km": 1000.0, "cm": 0.01, "mm": 0.001, "mi": 1609.344, "ft": 0.3048,
               "in": 0.0254},
    "mass": {"kg": 1.0, "g": 0.001, "mg": 1e-6, "t": 1000.0, "lb": 0.45359237, "oz": 0.028349523125},
    "time": {"s": 1.0, "min": 60.0, "h": 3600.0, "day": 86400.0, "week": 604800.0},
}
# Temperature is affine (an offset, not a factor), so it is converted through kelvin.
TEMPERATURE_UNITS = ("C", "F", "K")
UNIT_DIMENSIONS: dict[str, str] = {
    **{unit: dimension for dimension, factors in UNIT_FACTORS.items() for unit in factors},
    **{unit: "temperature" for unit in TEMPERATURE_UNITS},
}

_BINARY_OPERATORS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY_OPERATORS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def round_result(value: int | float) -> int | float:
    """Round to SIGNIFICANT_DIGITS (never dropping integer digits) so a student can copy it;
    integral floats become ints ("2", not "2.0")."""
    if isinstance(value, int) or value == 0:
        return int(value)
    decimals = SIGNIFICANT_DIGITS - 1 - math.floor(math.log10(abs(value)))
    rounded = round(value, max(decimals, 0))
    return int(rounded) if rounded.is_integer() and abs(rounded) < 2**53 else rounded


def calculator(expression: str) -> dict:
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r} as an arithmetic expression") from None
    return {"result": round_result(_evaluate(tree.body))}


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPERATORS:
        value = _UNARY_OPERATORS[type(node.op)](_evaluate(node.operand))
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is outside [-{MAX_EXPONENT}, {MAX_EXPONENT}]")
        try:
            value = _BINARY_OPERATORS[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError(f"result magnitude exceeds {MAX_MAGNITUDE:g}") from None
    else:
        raise ValueError(f"{type(node).__name__} is not allowed: use numbers, + - * / // % ** "
                         "and parentheses")
    if isinstance(value, complex):
        raise ValueError("result is a complex number")
    if abs(value) > MAX_MAGNITUDE or (isinstance(value, float) and math.isnan(value)):
        raise ValueError(f"result magnitude exceeds {MAX_MAGNITUDE:g}")
    return value


def convert(value: float, from_unit: str, to_unit: str) -> float:
    """Unrounded conversion; `convert_units` is the tool that rounds it for the student."""
    for unit in (from_unit, to_unit):
        if unit not in UNIT_DIMENSIONS:
            raise ValueError(f"unknown unit {unit!r}")
    source, target = UNIT_DIMENSIONS[from_unit], UNIT_DIMENSIONS[to_unit]
    if source != target:
        raise ValueError(f"cannot convert {source} ({from_unit}) to {target} ({to_unit})")
    if source != "temperature":
        return value * UNIT_FACTORS[source][from_unit] / UNIT_FACTORS[source][to_unit]
    kelvin = {"C": value + 273.15, "F": (value - 32) * 5 / 9 + 273.15, "K": value}[from_unit]
    if kelvin < 0:
        raise ValueError(f"{value} {from_unit} is below absolute zero")
    return {"C": kelvin - 273.15, "F": (kelvin - 273.15) * 9 / 5 + 32, "K": kelvin}[to_unit]


def convert_units(value: float, from_unit: str, to_unit: str) -> dict:
    result = convert(value, from_unit, to_unit)
    if not math.isfinite(result) or abs(result) > MAX_MAGNITUDE:
        raise ValueError(f"result magnitude exceeds {MAX_MAGNITUDE:g}")
    return {"result": round_result(result)}


_ENTITY_BY_KEY = {name.casefold(): name for name in LOOKUP_TABLE}


def lookup(entity: str, attribute: str) -> dict:
    name = _ENTITY_BY_KEY.get(" ".join(entity.split()).casefold())
    if name is None:
        raise ValueError(f"unknown entity {entity!r}")
    if attribute not in LOOKUP_ATTRIBUTES:
        raise ValueError(f"unknown attribute {attribute!r}; use one of {', '.join(LOOKUP_ATTRIBUTES)}")
    return {"result": LOOKUP_TABLE[name][attribute]}


def _function_schema(name: str, description: str, properties: dict) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties,
                           "required": list(properties), "additionalProperties": False},
        },
    }


_UNITS = list(UNIT_DIMENSIONS)
TOOL_SCHEMAS: list[dict] = [
    _function_schema(
        "calculator", "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
        {"expression": {"type": "string", "description": "for example (3 + 4) * 2.5"}}),
    _function_schema(
        "convert_units", "Convert a value between units of length, mass, time or temperature.",
        {"value": {"type": "number"},
         "from_unit": {"type": "string", "enum": _UNITS},
         "to_unit": {"type": "string", "enum": _UNITS}}),
    _function_schema(
        "lookup", "Look up a numeric attribute of a place in the world table.",
        {"entity": {"type": "string", "description": "the place's name, for example Veltrane"},
         "attribute": {"type": "string", "enum": list(LOOKUP_ATTRIBUTES)}}),
]
TOOL_FUNCTIONS = {"calculator": calculator, "convert_units": convert_units, "lookup": lookup}


def registry() -> ToolRegistry:
    """The toolcalc world's tools, as a recipe names them (`tools.registry`)."""
    return ToolRegistry([Tool(schema, TOOL_FUNCTIONS[schema["function"]["name"]])
                         for schema in TOOL_SCHEMAS])
