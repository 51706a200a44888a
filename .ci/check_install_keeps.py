"""Fail when installing fp4moe changed or removed a package that was installed before it.

    python .ci/check_install_keeps.py BEFORE.txt AFTER.txt     # two `pip freeze` outputs

fp4moe declares lower bounds only, so an install over the newest torch and transformers must add
packages (its own, the test extras) and change none: a downgrade here is a bound to lift."""

import sys


def versions(path: str) -> dict[str, str]:
    pins = {}
    for line in open(path):
        name, sep, version = line.strip().partition("==")
        if sep:
            pins[name.lower().replace("_", "-")] = version
    return pins


before, after = versions(sys.argv[1]), versions(sys.argv[2])
changed = {name: (v, after.get(name, "removed")) for name, v in before.items() if after.get(name) != v}
for name, (old, new) in sorted(changed.items()):
    print(f"installing fp4moe changed {name}: {old} -> {new}")
if changed:
    sys.exit(1)
print(f"installing fp4moe kept all {len(before)} packages as they were "
      f"(torch {before.get('torch')}, transformers {before.get('transformers')}, triton {before.get('triton')})")
