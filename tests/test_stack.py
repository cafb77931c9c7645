"""versions.py: the torch, numpy and transformers versions a run is silent on, names in one line, or stops on; and
the two requirement files it describes."""

import re

import pytest
from conftest import REPO, TINY
from packaging.specifiers import SpecifierSet

import precompute
from runs import versions

pytestmark = pytest.mark.stack  # the package stack itself: every test runs in each stack's lane

PINNED = {'torch': '2.7.0', 'numpy': '2.1.3', 'transformers': '4.57.6'}  # what make install resolves to


def installed(**changes) -> dict[str, str]:
    return {**PINNED, **changes}


def requirements(name: str) -> dict[str, str]:
    """package -> specifier of a requirements file's lines, without comments, markers or -r lines."""
    lines = (line.split('#')[0].split(';')[0].strip() for line in (REPO / name).read_text().splitlines())
    pattern = re.compile(r'([A-Za-z0-9_.-]+)(?:\[[^]]*\])?(.*)')  # name, [extras], specifier
    pairs = (pattern.match(line).groups() for line in lines if line and line[0] != '-')
    return {re.sub(r'[-_.]+', '-', package).lower(): specifier for package, specifier in pairs}


def test_the_pinned_versions_say_nothing():
    assert versions.stack_note(installed()) is None
    # a CUDA build's local version label, and the oldest numpy the pins allow
    assert versions.stack_note(installed(torch='2.7.0+cu126', numpy='1.26.4')) is None


def test_tested_versions_are_named_in_one_line():
    note = versions.stack_note(installed(torch='2.11.0', numpy='2.4.6'))
    assert note.startswith(
        'stack: torch 2.11.0, numpy 2.4.6, transformers 4.57.6: not the pinned versions '
        '(torch 2.7.0, numpy >=1.26,<2.2, transformers 4.57.6); tested to work: torch >=2.7,'
    )
    assert 'not tested' not in note
    assert '\n' not in note
    assert versions.stack_note(installed(torch='2.15.0+cpu')) is not None


def test_untested_versions_are_named_as_such():
    assert versions.stack_note(installed(torch='2.16.0')).endswith('; not tested on this torch')
    assert versions.stack_note(installed(torch='2.16.0.dev20261120', numpy='1.25.2')).endswith(
        '; not tested on this torch and numpy'
    )
    assert versions.stack_note(installed(transformers='4.56.2')).endswith('; not tested on this transformers')


@pytest.mark.parametrize('version', ['4.57.6', '5.17.0', '5.24.0'])
def test_both_transformers_ranges_are_tested(version):
    note = versions.stack_note(installed(torch='2.11.0', transformers=version))
    assert 'not tested' not in note and 'transformers 4.57.6 or >=5.17,<5.25' in note
    assert versions.stack_note(installed(transformers='5.3.0')).endswith('; not tested on this transformers')


def test_a_version_known_not_to_work_stops_with_what_to_install(monkeypatch):
    monkeypatch.setitem(versions.BROKEN, 'transformers', ('>=6', 'it breaks X; install Y'))
    with pytest.raises(versions.StackError, match=r'^transformers 6.0.0: this code does not work with it: it breaks X'):
        versions.stack_note(installed(transformers='6.0.0'))
    assert versions.stack_note(installed(transformers='5.24.0')) is not None  # named, not stopped


def test_check_stack_prints_the_note_on_rank_zero_only(monkeypatch, capsys):
    monkeypatch.setattr(versions, 'installed_versions', lambda: installed())
    versions.check_stack()
    assert capsys.readouterr().out == ''
    monkeypatch.setattr(versions, 'installed_versions', lambda: installed(torch='2.11.0'))
    versions.check_stack()
    assert capsys.readouterr().out == versions.stack_note(installed(torch='2.11.0')) + '\n'
    monkeypatch.setattr(versions.dist, 'get_global_rank', lambda: 1)
    versions.check_stack()
    assert capsys.readouterr().out == ''


def test_installed_versions_are_read_from_the_environment():
    installed = versions.installed_versions()
    assert sorted(installed) == sorted(versions.PACKAGES)
    assert all(re.match(r'\d+\.\d+', version) for version in installed.values())


def test_benchmark_and_precompute_stop_before_any_work(monkeypatch, capsys, tmp_path):
    import benchmark

    monkeypatch.setitem(versions.BROKEN, 'transformers', ('>=5.24', 'it breaks X; install Y'))
    monkeypatch.setattr(versions, 'installed_versions', lambda: installed(transformers='5.24.0'))
    with pytest.raises(SystemExit) as stopped:
        benchmark.cli(TINY)
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith('error: transformers 5.24.0: ')
    assert error.count('\n') == 1
    with pytest.raises(versions.StackError, match='^transformers 5.24.0'):
        precompute.main(['--out', str(tmp_path / 'latents')])
    assert not (tmp_path / 'latents').exists()


def test_the_pins_agree_with_the_requirement_files():
    pinned = requirements('requirements.txt')
    for package in versions.PACKAGES:
        assert SpecifierSet(pinned[package]) == SpecifierSet(versions.PINNED[package])
        assert PINNED[package] in SpecifierSet(pinned[package])
    current = requirements('requirements-current.txt')
    # requirements-current.txt goes on top of a machine's own torch, torchvision and numpy, with --no-deps:
    # every line pinned, none of those three, and the packages both files name at the same version.
    assert all(specifier.startswith('==') for specifier in current.values())
    assert not {'torch', 'torchvision', 'numpy', 'triton', 'xformers'} & set(current)
    assert not [package for package in current if package.startswith('nvidia')]
    shared = set(pinned) & set(current)
    assert {'mosaicml', 'mosaicml-streaming', 'diffusers', 'transformers', 'huggingface-hub', 'boto3'} <= shared
    # Both files pin the same versions, except the Hugging Face libraries: requirements-current.txt has their newest
    # releases (Transformers 5 and huggingface_hub 2), which Composer's torch <2.7.1 keeps out of the pinned stack;
    # torchao, whose releases follow torch's; torchmetrics past the <1.7.5 Composer declares, as GPU images have it.
    newest = {'diffusers', 'transformers', 'huggingface-hub', 'tokenizers', 'torchao', 'torchmetrics'}
    assert [p for p in shared - newest if current[p][2:] not in SpecifierSet(pinned[p])] == []
    for transformers in (pinned['transformers'], current['transformers']):
        assert any(transformers[2:] in SpecifierSet(tested) for tested in versions.TESTED['transformers'])
    assert int(current['transformers'][2:].split('.')[0]) == 5 and int(current['huggingface-hub'][2:][0]) >= 1


def test_the_gpu_image_file_adds_only_what_the_image_lacks():
    current, image = requirements('requirements-current.txt'), requirements('requirements-gpu-image.txt')
    assert set(image) < set(current) and all(image[package] == current[package] for package in image)
    assert {'mosaicml', 'mosaicml-streaming', 'diffusers', 'clip-anytorch', 'ftfy', 'zstd'} <= set(image)
    # the image's own: never replaced
    assert not {'torch', 'numpy', 'transformers', 'huggingface-hub', 'tokenizers', 'safetensors', 'torchmetrics'} & set(
        image
    )
