// Package atomlog is a Go client of atomlog, written from its protos and docs/ (see
// docs/clients.md): routing by metadata, an idempotent producer, consumers by offset
// and through named subscriptions, transactions (streaming and one-call, with Kafka-style
// transactional ids) and typed errors.
//
//	client, err := atomlog.Dial("127.0.0.1:7000")
//	producer, err := client.NewProducer(ctx, atomlog.ProducerOptions{})
//	delivery, err := producer.Send(ctx, "orders", atomlog.Record{Value: []byte("hello")})
//	meta, err := delivery.Wait(ctx)
package atomlog

import (
	"context"
	"crypto/tls"
	"math/rand/v2"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"

	pb "github.com/atomlog/atomlog/clients/go/gen/atomlog/v1"
)

// Options of a Client.
type Options struct {
	// RequestTimeout bounds one attempt of one RPC (default 30 s). Whole operations are
	// bounded by their context.
	RequestTimeout time.Duration
	// DialOptions are added to every connection (default: plaintext).
	DialOptions []grpc.DialOption
	// TLS, when set, secures every connection (WithTLS).
	TLS *TLSConfig
	// Token or TokenFile, when set, is sent as a bearer token on every call
	// (WithBearerToken, WithBearerTokenFile).
	Token     string
	TokenFile string
	// NoLinks sends every call over gRPC: none on the servers' links (WithoutLinks).
	// Links are used only when DialOptions is empty (a link cannot apply dial options).
	NoLinks bool
	// SpreadOneCalls places each one-call transaction (NewOneCallTxn) on the TC partition
	// its random key hashes to. By default those with a timeout up to 60 s gather on each
	// coordinator's lowest TC partition, a coordinator in turn, where under load their
	// commits share log appends (docs/coordinator.md, "Gathered one-call commits").
	SpreadOneCalls bool
}

// Client is a connection to an atomlog cluster: one gRPC connection per server, a
// metadata cache (topics → partition owners, TC partitions → coordinators) refreshed when
// a server says it is stale. Safe for concurrent use; share one per process.
type Client struct {
	bootstrap []string
	opts      Options
	transport credentials.TransportCredentials // nil: plaintext
	tls       *tls.Config                      // what transport wraps (nil: plaintext)
	token     *bearer                          // nil: no bearer token

	connMu sync.Mutex
	conns  map[string]*grpc.ClientConn
	links  map[string]*serverLink // by the server's gRPC address
	// linkCalls counts calls answered on the servers' links (tests).
	linkCalls atomic.Int64
	// oneCallTurns picks the coordinator of the next gathered one-call transaction.
	oneCallTurns atomic.Uint64

	metaMu      sync.Mutex
	refreshMu   sync.Mutex // one refresh at a time
	topics      map[string][]route
	servers     []string
	tcRoutes    map[uint32]string
	tcCount     uint32
	coords      []string
	coordLinks  map[string]string // a coordinator's gRPC address -> its link's
	partLinks   map[string]string // a partition server's gRPC address -> its link's
	refreshedAt time.Time
	refreshes   int // how many GetMetadata calls refreshed the cache (tests)
}

type route struct {
	serverName string
	address    string // empty while the owner is down
}

const (
	minRefreshInterval = 50 * time.Millisecond
	maxMessageBytes    = 64 << 20
)

// Dial makes a client from any server's address ("host:port"; several separated by
// commas). Nothing is sent until the first call.
func Dial(bootstrap string, options ...func(*Options)) (*Client, error) {
	var addresses []string
	for _, a := range strings.Split(bootstrap, ",") {
		if a = strings.TrimSpace(a); a != "" {
			addresses = append(addresses, a)
		}
	}
	if len(addresses) == 0 {
		return nil, errorf(ReasonInvalidArgument, "no bootstrap address in %q", bootstrap)
	}
	opts := Options{RequestTimeout: 30 * time.Second}
	for _, option := range options {
		option(&opts)
	}
	transport, settings, err := transportCredentials(opts.TLS)
	if err != nil {
		return nil, err
	}
	token, err := newBearer(opts.Token, opts.TokenFile)
	if err != nil {
		return nil, err
	}
	return &Client{bootstrap: addresses, opts: opts, transport: transport, tls: settings,
		token: token, conns: map[string]*grpc.ClientConn{}, links: map[string]*serverLink{},
		topics: map[string][]route{}, tcRoutes: map[uint32]string{},
		coordLinks: map[string]string{}, partLinks: map[string]string{}}, nil
}

// WithoutLinks sets Options.NoLinks: every call over gRPC.
func WithoutLinks() func(*Options) {
	return func(o *Options) { o.NoLinks = true }
}

// WithRequestTimeout sets Options.RequestTimeout.
func WithRequestTimeout(d time.Duration) func(*Options) {
	return func(o *Options) { o.RequestTimeout = d }
}

// WithDialOptions adds gRPC dial options (TLS credentials, interceptors).
func WithDialOptions(dial ...grpc.DialOption) func(*Options) {
	return func(o *Options) { o.DialOptions = append(o.DialOptions, dial...) }
}

// Close closes every connection.
func (c *Client) Close() error {
	c.connMu.Lock()
	defer c.connMu.Unlock()
	for address, conn := range c.conns {
		conn.Close()
		delete(c.conns, address)
	}
	for address, link := range c.links {
		link.close()
		delete(c.links, address)
	}
	return nil
}

func (c *Client) conn(address string) (*grpc.ClientConn, error) {
	c.connMu.Lock()
	defer c.connMu.Unlock()
	if conn, ok := c.conns[address]; ok {
		return conn, nil
	}
	transport := c.transport
	if transport == nil {
		transport = insecure.NewCredentials()
	}
	dial := []grpc.DialOption{
		grpc.WithTransportCredentials(transport),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxMessageBytes),
			grpc.MaxCallSendMsgSize(maxMessageBytes)),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: 30 * time.Second,
			Timeout: 10 * time.Second}),
	}
	if c.token != nil {
		dial = append(dial, grpc.WithPerRPCCredentials(c.token))
	}
	conn, err := grpc.NewClient(address, append(dial, c.opts.DialOptions...)...)
	if err != nil {
		return nil, errorf(ReasonInvalidArgument, "address %q: %v", address, err)
	}
	c.conns[address] = conn
	return conn, nil
}

// partitionStub is the partition server at `address` as a PartitionServiceClient: the
// calls its link carries (Fetch; a subscription's Receive, Ack, Nack) go on the link
// (link.go); a producer sends its Produce calls on the link's pipeline (pipeline.go).
func (c *Client) partitionStub(address string) (pb.PartitionServiceClient, error) {
	conn, err := c.linked(address, false)
	if err != nil {
		return nil, err
	}
	return pb.NewPartitionServiceClient(conn), nil
}

// coordinatorStub is the coordinator at `address` as a CoordinatorServiceClient: the
// calls its link carries go on the link when it advertises one (link.go).
func (c *Client) coordinatorStub(address string) (pb.CoordinatorServiceClient, error) {
	conn, err := c.linked(address, true)
	if err != nil {
		return nil, err
	}
	return pb.NewCoordinatorServiceClient(conn), nil
}

// linked is the gRPC connection to the server at `address`, wrapped so that the calls
// its link carries go there when it advertises one as a coordinator (or, not
// `coordinator`, as a partition server; a combined server's one link is both, and one
// serverLink serves both roles).
func (c *Client) linked(address string, coordinator bool) (grpc.ClientConnInterface, error) {
	conn, err := c.conn(address)
	if err != nil {
		return nil, err
	}
	if link := c.link(address, coordinator); link != nil {
		return linkedConn{ClientConn: conn, link: link}, nil
	}
	return conn, nil
}

// link is the server at `address`'s link as it advertises one as a coordinator (or, not
// `coordinator`, as a partition server), or nil: none, or links are off.
func (c *Client) link(address string, coordinator bool) *serverLink {
	if c.opts.NoLinks || len(c.opts.DialOptions) > 0 {
		return nil
	}
	c.metaMu.Lock()
	linkAddress := c.partLinks[address]
	if coordinator {
		linkAddress = c.coordLinks[address]
	}
	c.metaMu.Unlock()
	if linkAddress == "" {
		return nil
	}
	c.connMu.Lock()
	defer c.connMu.Unlock()
	link := c.links[address]
	if link == nil || link.address != linkAddress { // new, or a restarted server
		if link != nil {
			link.close()
		}
		link = newServerLink(linkAddress, address, c.tls, c.token, &c.linkCalls)
		c.links[address] = link
	}
	return link
}

// attempt is the context of one RPC attempt: the caller's, cut to RequestTimeout.
func (c *Client) attempt(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, c.opts.RequestTimeout)
}

// ------------------------------------------------------------------- metadata service

// metadataCall runs fn against any reachable server: the bootstrap addresses first, then
// the servers of the last metadata answer. Unreachable servers are skipped.
func (c *Client) metadataCall(ctx context.Context, fn func(context.Context, pb.MetadataServiceClient) error) error {
	c.metaMu.Lock()
	others := []string{}
	for _, s := range c.servers {
		if !contains(c.bootstrap, s) {
			others = append(others, s)
		}
	}
	c.metaMu.Unlock()
	rand.Shuffle(len(others), func(i, j int) { others[i], others[j] = others[j], others[i] })
	var last error
	for _, address := range append(append([]string{}, c.bootstrap...), others...) {
		conn, err := c.conn(address)
		if err != nil {
			return err
		}
		actx, cancel := c.attempt(ctx)
		err = fromRPC(ctx, fn(actx, pb.NewMetadataServiceClient(conn)))
		cancel()
		switch Reason(err) {
		case "":
			return err // nil, or the caller's context
		case ReasonServerUnavailable, ReasonShuttingDown, ReasonRequestTimedOut, ReasonZooKeeperUnavailable:
			last = err
			continue
		}
		return err
	}
	return last
}

// Refresh reloads the metadata of the topics (all topics when none are named).
func (c *Client) Refresh(ctx context.Context, topics ...string) error {
	c.refreshMu.Lock()
	defer c.refreshMu.Unlock()
	c.metaMu.Lock()
	wait := time.Until(c.refreshedAt.Add(minRefreshInterval))
	c.metaMu.Unlock()
	if wait > 0 { // bound refresh storms after many routing errors
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	var reply *pb.GetMetadataResponse
	err := c.metadataCall(ctx, func(actx context.Context, stub pb.MetadataServiceClient) (err error) {
		reply, err = stub.GetMetadata(actx, &pb.GetMetadataRequest{Topics: topics})
		return err
	})
	if err != nil {
		return err
	}
	c.metaMu.Lock()
	defer c.metaMu.Unlock()
	for _, topic := range reply.GetTopics() {
		routes := make([]route, len(topic.GetPartitions()))
		for _, p := range topic.GetPartitions() {
			if int(p.GetPartition()) < len(routes) {
				routes[p.GetPartition()] = route{serverName: p.GetServerName(), address: p.GetServerAddress()}
			}
		}
		c.topics[topic.GetName()] = routes
	}
	c.servers = c.servers[:0]
	c.coords = c.coords[:0]
	c.coordLinks = map[string]string{}
	c.partLinks = map[string]string{}
	for _, s := range reply.GetServers() {
		c.servers = append(c.servers, s.GetGrpcAddress())
		if s.GetRole() == pb.ServerRole_SERVER_ROLE_PARTITION_SERVER && s.GetLinkAddress() != "" {
			c.partLinks[s.GetGrpcAddress()] = s.GetLinkAddress()
		}
		if s.GetRole() == pb.ServerRole_SERVER_ROLE_COORDINATOR {
			c.coords = append(c.coords, s.GetGrpcAddress())
			if s.GetLinkAddress() != "" {
				c.coordLinks[s.GetGrpcAddress()] = s.GetLinkAddress()
			}
		}
	}
	c.tcCount = reply.GetTcPartitionCount()
	c.tcRoutes = map[uint32]string{}
	for _, tc := range reply.GetTcPartitions() {
		c.tcRoutes[tc.GetTcPartition()] = tc.GetCoordinatorAddress()
	}
	c.refreshedAt = time.Now()
	c.refreshes++
	return nil
}

// invalidate drops a topic's routes: the next use asks the cluster again.
func (c *Client) invalidate(topic string) {
	c.metaMu.Lock()
	delete(c.topics, topic)
	c.metaMu.Unlock()
}

func (c *Client) routes(ctx context.Context, topic string) ([]route, error) {
	c.metaMu.Lock()
	routes, ok := c.topics[topic]
	c.metaMu.Unlock()
	if ok {
		return routes, nil
	}
	if err := c.Refresh(ctx, topic); err != nil {
		return nil, err
	}
	c.metaMu.Lock()
	routes, ok = c.topics[topic]
	c.metaMu.Unlock()
	if !ok {
		return nil, errorf(ReasonUnknownTopicOrPartition, "no topic %q", topic)
	}
	return routes, nil
}

// Partitions is the number of partitions of a topic.
func (c *Client) Partitions(ctx context.Context, topic string) (int, error) {
	routes, err := c.routes(ctx, topic)
	return len(routes), err
}

// owner is the gRPC address of a partition's owner (SERVER_UNAVAILABLE while it is down).
func (c *Client) owner(ctx context.Context, tp TopicPartition) (string, error) {
	routes, err := c.routes(ctx, tp.Topic)
	if err != nil {
		return "", err
	}
	if tp.Partition < 0 || int(tp.Partition) >= len(routes) {
		return "", errorf(ReasonUnknownTopicOrPartition, "topic %q has %d partitions; no partition %d",
			tp.Topic, len(routes), tp.Partition)
	}
	if routes[tp.Partition].address == "" {
		c.invalidate(tp.Topic)
		return "", errorf(ReasonServerUnavailable, "the owner of %s (%s) is down", tp,
			routes[tp.Partition].serverName)
	}
	return routes[tp.Partition].address, nil
}

// byOwner groups partitions by the address of their owner; the ones whose owner is
// unknown or down come back as the error of each.
func (c *Client) byOwner(ctx context.Context, tps []TopicPartition) (map[string][]TopicPartition, map[TopicPartition]error) {
	groups := map[string][]TopicPartition{}
	failed := map[TopicPartition]error{}
	for _, tp := range tps {
		address, err := c.owner(ctx, tp)
		if err != nil {
			failed[tp] = err
			continue
		}
		groups[address] = append(groups[address], tp)
	}
	return groups, failed
}

// routingReasons make a client drop its routes for the topic.
func isRoutingError(err error) bool {
	switch Reason(err) {
	case ReasonNotPartitionOwner, ReasonUnknownTopicOrPartition, ReasonServerUnavailable:
		return true
	}
	return false
}

// TopicInfo describes a created topic.
type TopicInfo struct {
	Name       string
	Partitions int
}

// CreateTopic creates a topic of `partitions` partitions (config: per-topic settings).
// TOPIC_ALREADY_EXISTS when it exists.
func (c *Client) CreateTopic(ctx context.Context, name string, partitions int, config map[string]string) (TopicInfo, error) {
	var reply *pb.CreateTopicResponse
	err := c.metadataCall(ctx, func(actx context.Context, stub pb.MetadataServiceClient) (err error) {
		reply, err = stub.CreateTopic(actx, &pb.CreateTopicRequest{Name: name,
			Partitions: uint32(partitions), Config: config})
		return err
	})
	if err != nil {
		return TopicInfo{}, err
	}
	c.invalidate(name)
	return TopicInfo{Name: reply.GetTopic().GetName(), Partitions: len(reply.GetTopic().GetPartitions())}, nil
}

// AlterTopicConfig changes a topic's settings: set adds or replaces keys, del removes
// them (back to the servers' default); the partition servers apply them without a
// restart. Returns the topic's settings after the change. The change is checked whole
// before anything is written: INVALID_TOPIC_CONFIG changes nothing.
func (c *Client) AlterTopicConfig(ctx context.Context, name string, set map[string]string, del []string) (map[string]string, error) {
	var reply *pb.AlterTopicConfigResponse
	err := c.metadataCall(ctx, func(actx context.Context, stub pb.MetadataServiceClient) (err error) {
		reply, err = stub.AlterTopicConfig(actx, &pb.AlterTopicConfigRequest{Topic: name,
			Set: set, Delete: del})
		return err
	})
	if err != nil {
		return nil, err
	}
	c.invalidate(name)
	config := map[string]string{}
	for k, v := range reply.GetTopic().GetConfig() {
		config[k] = v
	}
	return config, nil
}

// ListTopics names every topic (internal ones too with internal=true), sorted.
func (c *Client) ListTopics(ctx context.Context, internal bool) ([]string, error) {
	var reply *pb.ListTopicsResponse
	err := c.metadataCall(ctx, func(actx context.Context, stub pb.MetadataServiceClient) (err error) {
		reply, err = stub.ListTopics(actx, &pb.ListTopicsRequest{IncludeInternal: internal})
		return err
	})
	if err != nil {
		return nil, err
	}
	names := append([]string{}, reply.GetNames()...)
	sort.Strings(names)
	return names, nil
}

// ------------------------------------------------------------------- coordinators

// TCPartitionFor is coordinator.proto's tc_partition_for: CRC32C of the key's UTF-8
// bytes modulo the TC partition count.
func TCPartitionFor(key string, count uint32) uint32 { return CRC32C([]byte(key)) % count }

func (c *Client) tcPartitionCount(ctx context.Context) (uint32, error) {
	c.metaMu.Lock()
	count := c.tcCount
	c.metaMu.Unlock()
	if count > 0 {
		return count, nil
	}
	if err := c.Refresh(ctx); err != nil {
		return 0, err
	}
	c.metaMu.Lock()
	defer c.metaMu.Unlock()
	if c.tcCount == 0 {
		return 0, errorf(ReasonServerUnavailable, "the cluster reports no TC partitions")
	}
	return c.tcCount, nil
}

// coordinatorRetry: answers after which the same coordinator call is retried; the
// routing ones after a metadata refresh.
func coordinatorRetry(err error) (retry, refresh bool) {
	switch Reason(err) {
	case ReasonNotCoordinator, ReasonServerUnavailable, ReasonShuttingDown, ReasonRequestTimedOut:
		return true, true
	case ReasonCoordinatorLoading, ReasonConcurrentTransactions, ReasonZooKeeperUnavailable:
		return true, false
	}
	return false, false
}

// defaultOperationTimeout bounds retries of an operation whose context has no deadline.
const defaultOperationTimeout = 60 * time.Second

// coordinatorCall runs fn on the coordinator owning TC partition tc, retried on the
// retriable answers (the lease moving, a TC partition loading, concurrent changes, an
// unreachable server) at most 0.25 s apart, until ctx ends (or 60 s without a deadline).
// Every call made this way is safe to repeat (idempotency keys, sessions, EndTxn).
func (c *Client) coordinatorCall(ctx context.Context, tc uint32,
	fn func(context.Context, pb.CoordinatorServiceClient) error) error {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, defaultOperationTimeout)
		defer cancel()
	}
	backoff := newBackoff(20*time.Millisecond, 250*time.Millisecond)
	var last error
	for {
		c.metaMu.Lock()
		address := c.tcRoutes[tc]
		c.metaMu.Unlock()
		if address == "" {
			if err := c.Refresh(ctx); err != nil && ctx.Err() == nil {
				last = err
			}
			c.metaMu.Lock()
			address = c.tcRoutes[tc]
			c.metaMu.Unlock()
		}
		if address != "" {
			stub, err := c.coordinatorStub(address)
			if err != nil {
				return err
			}
			actx, cancel := c.attempt(ctx)
			err = fromRPC(ctx, fn(actx, stub))
			cancel()
			if err == nil || ctx.Err() != nil {
				if err == nil {
					return nil
				}
				return lastOr(last, err)
			}
			retry, refresh := coordinatorRetry(err)
			if !retry {
				return err
			}
			last = err
			if refresh {
				c.Refresh(ctx) //nolint:errcheck // retried all the same
			}
		} else if last == nil {
			last = errorf(ReasonNotCoordinator, "TC partition %d has no owner now", tc)
		}
		if !sleep(ctx, backoff.next()) {
			return lastOr(last, ctx.Err())
		}
	}
}

// lastOr prefers the last atomlog error over a bare context error: "deadline exceeded"
// alone hides why the call never went through.
func lastOr(last, err error) error {
	if last != nil {
		return &wrapped{err: last, ctx: err}
	}
	return err
}

// wrapped is an atomlog error that ran out of time: errors.Is matches both.
type wrapped struct {
	err error // the last *Error
	ctx error // the context's error
}

func (w *wrapped) Error() string   { return w.err.Error() + " (" + w.ctx.Error() + ")" }
func (w *wrapped) Unwrap() []error { return []error{w.err, w.ctx} }

// allocateProducerID is InitProducerId without a transactional id, at any coordinator.
func (c *Client) allocateProducerID(ctx context.Context) (int64, uint16, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, defaultOperationTimeout)
		defer cancel()
	}
	backoff := newBackoff(50*time.Millisecond, 2*time.Second)
	var last error
	for attempt := 0; ; attempt++ {
		c.metaMu.Lock()
		coords := append([]string{}, c.coords...)
		c.metaMu.Unlock()
		if attempt > 0 || len(coords) == 0 {
			if err := c.Refresh(ctx); err != nil {
				last = err
			}
			c.metaMu.Lock()
			coords = append([]string{}, c.coords...)
			c.metaMu.Unlock()
		}
		rand.Shuffle(len(coords), func(i, j int) { coords[i], coords[j] = coords[j], coords[i] })
		for _, address := range coords {
			stub, err := c.coordinatorStub(address)
			if err != nil {
				return 0, 0, err
			}
			actx, cancel := c.attempt(ctx)
			reply, err := stub.InitProducerId(actx, &pb.InitProducerIdRequest{})
			cancel()
			if err = fromRPC(ctx, err); err == nil {
				return reply.GetProducerId(), uint16(reply.GetProducerEpoch()), nil
			}
			if !IsRetriable(err) {
				return 0, 0, err
			}
			last = err
		}
		if last == nil {
			last = errorf(ReasonServerUnavailable, "no coordinator is registered")
		}
		if !sleep(ctx, backoff.next()) {
			return 0, 0, lastOr(last, ctx.Err())
		}
	}
}

// ------------------------------------------------------------------- helpers

type backoff struct {
	delay, max time.Duration
}

func newBackoff(initial, max time.Duration) *backoff { return &backoff{delay: initial, max: max} }

// next is the next pause: doubling up to max, with jitter in [50%, 100%].
func (b *backoff) next() time.Duration {
	d := b.delay
	b.delay = min(2*b.delay, b.max)
	return d/2 + time.Duration(rand.Int64N(int64(d/2)+1))
}

// sleep waits d or until ctx ends (false).
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
