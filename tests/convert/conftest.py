"""Data fixtures: one conversion of the sample data, made once per session and shared by the tests."""


import pytest

RESOLUTIONS = (32, 64)  # small, but two of them: one decode must feed every resolution


@pytest.fixture(scope="session")
def convert_config(sample_data, tiny_kit):
    """Build a ConvertConfig over the sample data with the tiny kit; keyword overrides."""
    from diffusion.convert.pipeline import ConvertConfig

    def make(output, **overrides):
        options = dict(input=sample_data, output=str(output), model=tiny_kit, resolutions=RESOLUTIONS,
                       progress=False)
        options.update(overrides)
        return ConvertConfig(**options)
    return make


@pytest.fixture(scope="session")
def converted(convert_config, ray_local, tmp_path_factory):
    """(output dir, summary) of a clean conversion of the 96-row sample, with a 2-row visualization."""
    from diffusion.convert.pipeline import run_conversion
    out = tmp_path_factory.mktemp("converted")
    summary = run_conversion(convert_config(out, visualize=2))
    return str(out), summary
