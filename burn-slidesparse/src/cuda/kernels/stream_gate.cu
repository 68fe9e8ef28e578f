// The stream gate of the benchmarks (`gate.rs`, feature `internals`): a spin wait on a
// device flag, which closes burn's stream, and the flag store that opens it from a stream of
// ours. Kernels because the driver's stream memory operations (`cuStreamWaitValue32`) reject
// cubecl's memory (it comes from the stream-ordered allocator).

extern "C" __global__ void slidesparse_wait(const volatile unsigned int* flag, unsigned int epoch,
                                            unsigned int* timed_out, unsigned int max_spins) {
    unsigned int spins = 0;
    while (*flag < epoch) {
        if (++spins >= max_spins) { *timed_out = epoch; return; }
        __nanosleep(64);
    }
    __threadfence();
}
extern "C" __global__ void slidesparse_signal(volatile unsigned int* flag, unsigned int epoch) {
    __threadfence_system();
    *flag = epoch;
}
