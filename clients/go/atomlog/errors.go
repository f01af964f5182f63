package atomlog

//go:generate go run ../internal/genreasons ../../../docs/errors.md reasons_gen.go

import (
	"context"
	"errors"
	"fmt"
	"sort"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/atomlog/atomlog/clients/go/gen/atomlog/v1"
)

// Domain is the google.rpc.ErrorInfo domain of every atomlog error.
const Domain = "atomlog.v1"

// Outcome says what a caller does about an error (docs/errors.md).
type Outcome int

const (
	// Fatal: the request or the caller's state is wrong; retrying it unchanged fails.
	Fatal Outcome = iota
	// Retriable: the same request may succeed later; retrying is safe.
	Retriable
	// Abortable: the transaction or producer session cannot continue; abort it and start
	// a new one.
	Abortable
)

func (o Outcome) String() string {
	switch o {
	case Retriable:
		return "retriable"
	case Abortable:
		return "abortable"
	default:
		return "fatal"
	}
}

// Error is a failure reported by an atomlog server (the ErrorInfo of a failed call, or
// the ItemError of one item of a batched call), or by this client for transport failures
// that carry no ErrorInfo (SERVER_UNAVAILABLE, REQUEST_TIMED_OUT).
//
// Compare with errors.Is against the sentinels (errors.Is(err, atomlog.ErrProducerFenced))
// or read Reason; Retriable() and Abortable() follow docs/errors.md.
type Error struct {
	// Reason is the UPPER_SNAKE_CASE reason of docs/errors.md, e.g. "NOT_PARTITION_OWNER".
	Reason string
	// Message is for people; never parse it.
	Message string
	// Metadata holds the ErrorInfo (or ItemError) metadata, e.g. "owner_address".
	Metadata map[string]string
	// Code is the gRPC status code of the failed call (for an item error: the code the
	// reason has when it fails a whole call).
	Code codes.Code
}

func (e *Error) Error() string {
	if e.Message == "" {
		return e.Reason
	}
	return e.Reason + ": " + e.Message
}

// Outcome is what docs/errors.md says about the reason; an unknown reason is Fatal.
func (e *Error) Outcome() Outcome {
	if info, ok := reasons[e.Reason]; ok {
		return info.outcome
	}
	return Fatal
}

// Retriable: the same request may succeed later (after a metadata refresh for routing
// errors). The client has already retried it within its deadline.
func (e *Error) Retriable() bool { return e.Outcome() == Retriable }

// Abortable: abort the transaction (or producer session) and start a new one.
func (e *Error) Abortable() bool { return e.Outcome() == Abortable }

// Is matches an *Error of the same reason, so errors.Is(err, ErrProducerFenced) works.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Reason == e.Reason
}

// Reason of an error: the atomlog reason if err is (or wraps) an *Error, else "".
func Reason(err error) string {
	var e *Error
	if errors.As(err, &e) {
		return e.Reason
	}
	return ""
}

// IsRetriable reports whether err is (or wraps) a retriable *Error.
func IsRetriable(err error) bool {
	var e *Error
	return errors.As(err, &e) && e.Retriable()
}

// IsAbortable reports whether err is (or wraps) an abortable *Error.
func IsAbortable(err error) bool {
	var e *Error
	return errors.As(err, &e) && e.Abortable()
}

// Reason strings used by this client's logic; reasons lists every one of them.
const (
	ReasonInvalidArgument             = "INVALID_ARGUMENT"
	ReasonTopicAlreadyExists          = "TOPIC_ALREADY_EXISTS"
	ReasonUnknownTopicOrPartition     = "UNKNOWN_TOPIC_OR_PARTITION"
	ReasonCorruptBatch                = "CORRUPT_BATCH"
	ReasonCRCMismatch                 = "CRC_MISMATCH"
	ReasonBatchTooLarge               = "BATCH_TOO_LARGE"
	ReasonOffsetOutOfRange            = "OFFSET_OUT_OF_RANGE"
	ReasonNotPartitionOwner           = "NOT_PARTITION_OWNER"
	ReasonZooKeeperUnavailable        = "ZOOKEEPER_UNAVAILABLE"
	ReasonShuttingDown                = "SHUTTING_DOWN"
	ReasonServerUnavailable           = "SERVER_UNAVAILABLE"
	ReasonRequestTimedOut             = "REQUEST_TIMED_OUT"
	ReasonResourceExhausted           = "RESOURCE_EXHAUSTED"
	ReasonDataLoss                    = "DATA_LOSS"
	ReasonPartitionLoading            = "PARTITION_LOADING"
	ReasonNotEnoughReplicas           = "NOT_ENOUGH_REPLICAS"
	ReasonOutOfOrderSequence          = "OUT_OF_ORDER_SEQUENCE"
	ReasonProducerFenced              = "PRODUCER_FENCED"
	ReasonUnknownProducerID           = "UNKNOWN_PRODUCER_ID"
	ReasonCoordinatorLoading          = "COORDINATOR_LOADING"
	ReasonNotCoordinator              = "NOT_COORDINATOR"
	ReasonConcurrentTransactions      = "CONCURRENT_TRANSACTIONS"
	ReasonInvalidTransactionTimeout   = "INVALID_TRANSACTION_TIMEOUT"
	ReasonUnknownTransaction          = "UNKNOWN_TRANSACTION"
	ReasonTransactionNotOpen          = "TRANSACTION_NOT_OPEN"
	ReasonTransactionAlreadyCommitted = "TRANSACTION_ALREADY_COMMITTED"
	ReasonTransactionAborted          = "TRANSACTION_ABORTED"
	ReasonTransactionTimedOut         = "TRANSACTION_TIMED_OUT"
	ReasonTransactionConflict         = "TRANSACTION_CONFLICT"
	ReasonPartitionNotInTransaction   = "PARTITION_NOT_IN_TRANSACTION"
	ReasonUnknownSubscription         = "UNKNOWN_SUBSCRIPTION"
	ReasonUnauthenticated             = "UNAUTHENTICATED"
	ReasonPermissionDenied            = "PERMISSION_DENIED"
	ReasonUnimplemented               = "UNIMPLEMENTED"
	ReasonInternal                    = "INTERNAL"
)

// Sentinels for errors.Is.
var (
	ErrNotPartitionOwner           = &Error{Reason: ReasonNotPartitionOwner}
	ErrUnknownTopicOrPartition     = &Error{Reason: ReasonUnknownTopicOrPartition}
	ErrTopicAlreadyExists          = &Error{Reason: ReasonTopicAlreadyExists}
	ErrCorruptBatch                = &Error{Reason: ReasonCorruptBatch}
	ErrCRCMismatch                 = &Error{Reason: ReasonCRCMismatch}
	ErrBatchTooLarge               = &Error{Reason: ReasonBatchTooLarge}
	ErrProducerFenced              = &Error{Reason: ReasonProducerFenced}
	ErrOutOfOrderSequence          = &Error{Reason: ReasonOutOfOrderSequence}
	ErrTransactionAborted          = &Error{Reason: ReasonTransactionAborted}
	ErrTransactionTimedOut         = &Error{Reason: ReasonTransactionTimedOut}
	ErrTransactionConflict         = &Error{Reason: ReasonTransactionConflict}
	ErrTransactionNotOpen          = &Error{Reason: ReasonTransactionNotOpen}
	ErrTransactionAlreadyCommitted = &Error{Reason: ReasonTransactionAlreadyCommitted}
	ErrUnknownSubscription         = &Error{Reason: ReasonUnknownSubscription}
	ErrRequestTimedOut             = &Error{Reason: ReasonRequestTimedOut}
	ErrServerUnavailable           = &Error{Reason: ReasonServerUnavailable}
	ErrDataLoss                    = &Error{Reason: ReasonDataLoss}
	ErrUnauthenticated             = &Error{Reason: ReasonUnauthenticated}
	ErrPermissionDenied            = &Error{Reason: ReasonPermissionDenied}
)

type reasonInfo struct {
	code    codes.Code
	outcome Outcome
}

// Reasons lists every reason this client knows, sorted.
func Reasons() []string {
	out := make([]string, 0, len(reasons))
	for reason := range reasons {
		out = append(out, reason)
	}
	sort.Strings(out)
	return out
}

// OutcomeOf is docs/errors.md's outcome for a reason (Fatal when unknown).
func OutcomeOf(reason string) Outcome { return (&Error{Reason: reason}).Outcome() }

// newError makes an *Error with the code its reason has in the table.
func newError(reason, message string, metadata map[string]string) *Error {
	code := codes.Unknown
	if info, ok := reasons[reason]; ok {
		code = info.code
	}
	return &Error{Reason: reason, Message: message, Metadata: metadata, Code: code}
}

func errorf(reason, format string, args ...any) *Error {
	return newError(reason, fmt.Sprintf(format, args...), nil)
}

// itemError is the *Error of a batched call's item, nil when the item succeeded.
func itemError(item *pb.ItemError) *Error {
	if item == nil || item.GetReason() == "" {
		return nil
	}
	return newError(item.GetReason(), item.GetMessage(), item.GetMetadata())
}

// bareCodeReasons maps a status without ErrorInfo (transport failures, deadlines) to the
// closest reason, as the Python SDK does.
var bareCodeReasons = map[codes.Code]string{
	codes.InvalidArgument:   ReasonInvalidArgument,
	codes.Unimplemented:     ReasonUnimplemented,
	codes.ResourceExhausted: ReasonResourceExhausted,
	codes.Unavailable:       ReasonServerUnavailable,
	codes.DeadlineExceeded:  ReasonRequestTimedOut,
}

// fromRPC turns the error of a gRPC call into an *Error (from the status's ErrorInfo).
// The caller's own context ending is returned as the context's error, unwrapped.
func fromRPC(ctx context.Context, err error) error {
	if err == nil {
		return nil
	}
	if ctxErr := ctx.Err(); ctxErr != nil {
		return ctxErr
	}
	st, ok := status.FromError(err)
	if !ok {
		return &Error{Reason: ReasonInternal, Message: err.Error(), Code: codes.Unknown}
	}
	for _, detail := range st.Details() {
		if info, ok := detail.(*errdetails.ErrorInfo); ok && info.GetDomain() == Domain {
			return &Error{Reason: info.GetReason(), Message: st.Message(),
				Metadata: info.GetMetadata(), Code: st.Code()}
		}
	}
	reason, ok := bareCodeReasons[st.Code()]
	if !ok {
		reason = ReasonInternal
	}
	return &Error{Reason: reason, Message: st.Message(),
		Metadata: map[string]string{"grpc_code": st.Code().String()},
		Code:     st.Code()}
}
