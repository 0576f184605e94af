# shellcheck shell=bash
# Sourced by run-agent and run-tests: make .venv ready with as little work as the change needs.
#
# venv_ready base|dev   creates .venv if missing and installs this checkout into it (editable, with
#                       the dev extras for "dev"), but only when pyproject.toml, the interpreter or the
#                       extras changed since the last install: the install is editable, so changes to
#                       the sources need none (a pip run costs 5-9 s here; a warm start ~1 s).
# Removing .venv/.nodeagent-installed forces the next install.

venv_ready() {
    local extras=$1 stamp=.venv/.nodeagent-installed want have
    [ -x .venv/bin/python ] || python3 -m venv .venv
    want="$(.venv/bin/python -c 'import sys; print(sys.version.split()[0])') $(sha256sum pyproject.toml | cut -d' ' -f1)"
    have=$(cat "$stamp" 2>/dev/null || true)
    # An install with the dev extras also serves run-agent.
    if [ "$have" = "dev $want" ] || [ "$have" = "$extras $want" ]; then
        return 0
    fi
    rm -f "$stamp"
    .venv/bin/python -m pip install -q --upgrade pip >/dev/null
    if [ "$extras" = dev ]; then
        .venv/bin/python -m pip install -q -e '.[dev]'
    else
        .venv/bin/python -m pip install -q -e .
    fi
    echo "$extras $want" > "$stamp"
}
