"""Schemathesis hooks of scripts/schemathesis (loaded through SCHEMATHESIS_HOOKS).

Random strings almost never name the configured plugin or one of its volumes, so without help
every volume and controller route would only ever answer 404 and the plugin would never be
called. Half of the generated requests are steered: each string that names a plugin becomes the
test plugin's type, each volume id one of its volumes, each workload one of two, and a
`bind_to` a path beneath the daemon's --bind-root, a capability a valid one (a random one
almost always names both or neither of `mount` and `block`), and a size and parameters of a
create ones the plugin accepts. Only positive cases are steered,
and only values that are already strings (or capabilities): a negative case (a number or an
empty string where a string belongs, a missing field) must stay negative, and a value that is
not there stays away.
"""

import os

import schemathesis
from hypothesis import strategies as st
from schemathesis import DataGenerationMethod
from schemathesis.serializers import OctetStreamSerializer

PLUGIN = "org.example.test"
# The test plugin's pre-provisioned volumes (scripts/schemathesis), and one it does not know.
VOLUMES = ["demo", "scratch", "no-such-volume"]
WORKLOADS = ["default", "w1"]
BIND_ROOT = os.environ.get("SCHEMATHESIS_BIND_ROOT", "")

PLUGIN_FIELDS = ("plugin", "type")
CAPABILITY = {"mount": {"fs_type": "", "mount_flags": []}, "access_mode": "SINGLE_NODE_WRITER"}


def _steer_map(values, volume, workload):
    """A copy of a body, path or query mapping with its names steered."""
    if not isinstance(values, dict):
        return values
    steered = dict(values)
    for key in PLUGIN_FIELDS:
        if isinstance(steered.get(key), str):
            steered[key] = PLUGIN
    for key in ("volume_id", "name"):
        if isinstance(steered.get(key), str):
            steered[key] = volume
    if isinstance(steered.get("workload"), str):
        steered["workload"] = workload
    if BIND_ROOT and isinstance(steered.get("bind_to"), str):
        steered["bind_to"] = f"{BIND_ROOT}/{workload}/{volume}"
    if isinstance(steered.get("capability"), dict):
        steered["capability"] = dict(CAPABILITY)
        steered["readonly"] = False
    if isinstance(steered.get("capabilities"), list):
        steered["capabilities"] = [dict(CAPABILITY)]
    # A random size is almost always beyond the plugin's pool (OUT_OF_RANGE), and random
    # parameters are refused by it (INVALID_ARGUMENT): a create would never succeed.
    if isinstance(steered.get("capacity_bytes"), int):
        steered["capacity_bytes"] = 1 << 20
    if isinstance(steered.get("parameters"), dict):
        steered["parameters"] = {}
    return steered


def _steer(drawn):
    case, steer, volume, workload = drawn
    if not steer or case.data_generation_method != DataGenerationMethod.positive:
        return case
    case.body = _steer_map(case.body, volume, workload)
    if case.path_parameters:
        case.path_parameters = _steer_map(case.path_parameters, volume, workload)
    if case.query:
        case.query = _steer_map(case.query, volume, workload)
    return case


@schemathesis.hook
def before_generate_case(context, strategy):
    return st.tuples(
        strategy, st.booleans(), st.sampled_from(VOLUMES), st.sampled_from(WORKLOADS)
    ).map(_steer)


# POST /v1/images/import takes a tar archive as its body (`format: binary`): sent as the bytes
# generated, like schemathesis sends application/octet-stream. Random bytes are not an image
# archive, so this exercises the daemon's refusals (a 400 naming what is wrong, never a 5xx).
schemathesis.serializer("application/x-tar")(OctetStreamSerializer)
