# shellcheck shell=bash
# Sourced by the scripts that run on a bare GPU machine: the project and the Python packages the machine lacks,
# installed without pip. Missing packages travel as pure-Python wheels in the checkout's ignored .whl/ folder;
# unpacked is installed. The project goes on PYTHONPATH as a package tree of links to the checkout, since the
# checkout's own capsnet/ folder holds only part of the package.

# unpack_wheels PYTHON REPO SITE: each wheel in REPO/.whl whose module PYTHON cannot import, unpacked into SITE
unpack_wheels() {
    local python=$1 repo=$2 site=$3 wheel module
    for wheel in "$repo"/.whl/*.whl; do
        [ -e "$wheel" ] || continue
        module=$(basename "$wheel" | cut -d- -f1 | tr '[:upper:]' '[:lower:]')
        case $module in  # where a distribution's import name is not its own
            grpcio_health_checking) module=grpc_health ;;
            grpcio_reflection) module=grpc_reflection ;;
            python_rapidjson) module=rapidjson ;;
        esac
        "$python" -c "import $module" 2>/dev/null && continue
        echo "installing ${wheel##*/} (--no-deps)"
        "$python" -m zipfile -e "$wheel" "$site" || return 1
    done
}

# link_package_tree REPO PKG: PKG/capsnet, the capsnet package as links to the checkout's folders
link_package_tree() {
    local repo=$1 pkg=$2 sub
    mkdir -p "$pkg/capsnet"
    ln -s "$repo"/capsnet/* "$pkg/capsnet/"
    for sub in training export serving; do ln -s "$repo/$sub" "$pkg/capsnet/$sub"; done
}
