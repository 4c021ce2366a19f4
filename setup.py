"""Packaging: requirements live in requirements/*.txt so CI, the README and pip agree."""
import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def read_requirements(name: str) -> list[str]:
    with open(os.path.join(HERE, 'requirements', name)) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith('#')]


def read_version() -> str:
    scope: dict = {}
    with open(os.path.join(HERE, 'lmdeploy', 'version.py')) as f:
        exec(f.read(), scope)
    return scope['__version__']


setup(
    name='lmdeploy',
    version=read_version(),
    description='Inference and serving engine for hybrid LLMs with exact-step prefix caching',
    packages=find_packages(include=['lmdeploy', 'lmdeploy.*']),
    python_requires='>=3.10',
    install_requires=read_requirements('runtime.txt'),
    extras_require={'test': read_requirements('test.txt'), 'cuda': read_requirements('cuda.txt')},
    entry_points={'console_scripts': ['lmdeploy = lmdeploy.cli.entrypoint:run']},
    package_data={'lmdeploy': ['py.typed', 'pytorch/kernels/cuda/moe_configs/*.json']},
)
