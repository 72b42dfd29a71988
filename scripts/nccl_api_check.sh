INC=$(python3 -c "import nvidia.nccl as m, os; print(os.path.join(list(m.__path__)[0], 'include'))")
ls $INC; CUDA_INC=$(dirname $(dirname $(which nvcc)))/include
g++ -std=c++17 -fsyntax-only -DJAX_UB_HAVE_NCCL_H=1 -I csrc -I $INC -I $CUDA_INC csrc/comm/nccl_api_check.cc && echo API_CHECK_OK
grep -n "NCCL_MAJOR\|NCCL_MINOR" $INC/nccl.h | head -3
