"""`--otlp-traces-endpoint` values that cannot reach an OTLP collector are refused at start-up,
naming the option, rather than served with (a scheme no exporter speaks) or refused with a bare
parser error."""

from __future__ import annotations

import pytest

from cadence.config import ServerConfig

BAD = ["ftp://collector:4318", "file:///etc/passwd", "unix:///tmp/otlp.sock", "javascript://x",
       "http://[::1", "http://collector:99999", "http://collector:port"]


@pytest.mark.parametrize("endpoint", BAD)
def test_an_endpoint_no_otlp_exporter_can_use_is_refused_naming_the_option(endpoint):
    with pytest.raises(ValueError, match="otlp_traces_endpoint: must be"):
        ServerConfig(otlp_traces_endpoint=endpoint).validate()


@pytest.mark.parametrize("endpoint", ["http://c:4318", "https://c", "grpc://c:4317", "http://[::1]:4318/v1/traces",
                                      "HTTP://C:4318"])
def test_the_documented_schemes_are_accepted(endpoint):
    ServerConfig(otlp_traces_endpoint=endpoint).validate()
