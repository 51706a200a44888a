"""Packaging beyond pyproject.toml: ``fp4moe-autoload.pth`` goes to the root of site-packages, where
Python runs it at start-up (see fp4moe_autoload.py), in regular (``pip install .``, wheels) and
editable (``pip install -e .``) installs alike."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "fp4moe-autoload.pth"
PTH_SOURCE = Path(__file__).parent / PTH


class BuildPyWithPth(build_py):
    """build_py, plus the start-up hook's .pth at the root of the wheel."""

    def run(self):
        super().run()
        if not self.editable_mode:
            self.copy_file(str(PTH_SOURCE), str(Path(self.build_lib) / PTH), preserve_mode=0)

    def get_outputs(self, *args, **kwargs):
        outputs = super().get_outputs(*args, **kwargs)
        return outputs if self.editable_mode else [*outputs, str(Path(self.build_lib) / PTH)]


class _WithPth:
    """An editable-install strategy of setuptools (the files that point at the source tree), plus
    the start-up hook's .pth in the editable wheel."""

    def __init__(self, strategy):
        self.strategy = strategy

    def __call__(self, wheel, files, mapping):
        self.strategy(wheel, files, mapping)
        wheel.writestr(PTH, PTH_SOURCE.read_bytes())

    def __enter__(self):
        self.strategy.__enter__()
        return self

    def __exit__(self, *exc):
        return self.strategy.__exit__(*exc)


class EditableWheelWithPth(editable_wheel):
    def _select_strategy(self, *args, **kwargs):
        return _WithPth(super()._select_strategy(*args, **kwargs))


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
