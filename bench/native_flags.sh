# Sourced by the one-process A/B benches (kernel_ab.sh, attention_ab.sh): the g++ flags
# mashbox's native kernel build uses, against the .venv's torch and Python, as `flags`, and
# what links a harness against them, as `libs`.
torch=$(.venv/bin/python -c "import os, torch; print(os.path.dirname(torch.__file__))")
py_include=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['include'])")
py_lib=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))")
py_version=$(.venv/bin/python -c "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')")
flags=(-isystem "$torch/include" -isystem "$torch/include/torch/csrc/api/include"
  -isystem "$py_include" -fPIC -std=c++20 -O3 -march=native -fopenmp)
libs=(-L"$torch/lib" -ltorch -ltorch_cpu -ltorch_python -lc10 -L"$py_lib" -lpython"$py_version"
  -fopenmp -Wl,-rpath,"$torch/lib:$py_lib")
