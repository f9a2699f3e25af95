/* dlpack.h: our own declaration of the DLPack ABI structs we consume (layouts fixed by DLPack 1.x)
 * and of the DLPack 1.3 exchange table that torch >= 2.10 publishes as
 * torch.Tensor.__dlpack_c_exchange_api__. Not for: producing tensors (we only borrow). */
#ifndef ACC_DLPACK_H
#define ACC_DLPACK_H

#include <stdint.h>

typedef struct { uint32_t major, minor; } acc_DLPackVersion;

enum {
    acc_kDLCPU = 1, acc_kDLCUDA = 2, acc_kDLCUDAHost = 3, acc_kDLOpenCL = 4, acc_kDLVulkan = 7, acc_kDLMetal = 8,
    acc_kDLVPI = 9, acc_kDLROCM = 10, acc_kDLROCMHost = 11, acc_kDLExtDev = 12, acc_kDLCUDAManaged = 13,
    acc_kDLOneAPI = 14, acc_kDLWebGPU = 15, acc_kDLHexagon = 16, acc_kDLMAIA = 17
};
enum {
    acc_kDLInt = 0, acc_kDLUInt = 1, acc_kDLFloat = 2, acc_kDLBfloat = 4, acc_kDLBool = 6,
    acc_kDLFloat8_e4m3fn = 10, acc_kDLFloat8_e5m2 = 12,
};

typedef struct { int32_t device_type; int32_t device_id; } acc_DLDevice;
typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } acc_DLDataType;

typedef struct {
    void *data;
    acc_DLDevice device;
    int32_t ndim;
    acc_DLDataType dtype;
    int64_t *shape;
    int64_t *strides; /* in elements; may be NULL (compact row-major) in DLPack < 1.2 */
    uint64_t byte_offset;
} acc_DLTensor;

typedef struct acc_DLManagedTensor {
    acc_DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct acc_DLManagedTensor *self);
} acc_DLManagedTensor;

typedef struct acc_DLManagedTensorVersioned {
    acc_DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct acc_DLManagedTensorVersioned *self);
    uint64_t flags;
    acc_DLTensor dl_tensor;
} acc_DLManagedTensorVersioned;

/* The exchange table: header, then five nullable function pointers, in this order. */
typedef struct acc_DLPackExchangeAPIHeader {
    acc_DLPackVersion version;
    struct acc_DLPackExchangeAPIHeader *prev_api;
} acc_DLPackExchangeAPIHeader;

typedef struct {
    acc_DLPackExchangeAPIHeader header;
    void *managed_tensor_allocator;
    void *managed_tensor_from_py_object_no_sync;
    void *managed_tensor_to_py_object_no_sync;
    int (*dltensor_from_py_object_no_sync)(void *py_object, acc_DLTensor *out);
    int (*current_work_stream)(int32_t device_type, int32_t device_id, void **out_stream);
} acc_DLPackExchangeAPI;

#endif
