// Command sessiondriver is a trainer session written from docs/PROTOCOL.md and the Go code
// generated from proto/rollout/v1 (buf.gen.go.yaml): open, submit a group, read trajectories,
// acknowledge one, drop the stream abruptly, resume (the unacknowledged one is replayed),
// acknowledge it, wait for the heartbeat that confirms both acks, half-close. It prints one
// JSON line; tests/interop/test_go_client.py checks it against the server.
//
// Usage: sessiondriver ADDRESS CLIENT_ID
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"

	rolloutv1 "rollout-service/gen/go/rollout/v1"
)

type delivery struct {
	JobID      string  `json:"job_id"`
	DeliveryID int64   `json:"delivery_id"`
	Reward     float64 `json:"reward"`
}

type session struct {
	Replaying    int32      `json:"replaying"`
	AckedThrough int64      `json:"acked_through"`
	Accepted     []string   `json:"accepted"`
	Deliveries   []delivery `json:"deliveries"`
	Finished     []string   `json:"finished"`
	EndedWith    string     `json:"ended_with"`
}

// codec marshals with the protobuf APIv2 runtime. Debian's grpc-go 1.33 marshals through
// github.com/golang/protobuf 1.3, which predates the APIv2 messages protoc-gen-go writes now;
// with a current grpc-go (a Go module build) this codec is unnecessary.
type codec struct{}

func (codec) Marshal(v interface{}) ([]byte, error) { return proto.Marshal(v.(proto.Message)) }
func (codec) Unmarshal(data []byte, v interface{}) error {
	return proto.Unmarshal(data, v.(proto.Message))
}
func (codec) Name() string { return "proto" }

func init() { encoding.RegisterCodec(codec{}) }

func fail(err error) {
	fmt.Fprintln(os.Stderr, err)
	os.Exit(1)
}

func open(client rolloutv1.RolloutServiceClient, ctx context.Context, id string,
	ackedThrough int64) rolloutv1.RolloutService_StreamRolloutsClient {
	stream, err := client.StreamRollouts(ctx)
	if err != nil {
		fail(err)
	}
	err = stream.Send(&rolloutv1.StreamRolloutsRequest{Kind: &rolloutv1.StreamRolloutsRequest_Open{
		Open: &rolloutv1.OpenSession{
			ClientId: id, AckedThrough: ackedThrough,
			HeartbeatInterval: durationpb.New(200 * time.Millisecond)}}})
	if err != nil {
		fail(err)
	}
	return stream
}

func ack(stream rolloutv1.RolloutService_StreamRolloutsClient, id int64) {
	err := stream.Send(&rolloutv1.StreamRolloutsRequest{Kind: &rolloutv1.StreamRolloutsRequest_Ack{
		Ack: &rolloutv1.AckTrajectories{DeliveryIds: []int64{id}}}})
	if err != nil {
		fail(err)
	}
}

func main() {
	address, clientID := os.Args[1], os.Args[2]
	conn, err := grpc.Dial(address, grpc.WithInsecure(),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20)))
	if err != nil {
		fail(err)
	}
	defer conn.Close()
	client := rolloutv1.NewRolloutServiceClient(conn)
	var sessions []*session

	// Session 1: two jobs of a group; acknowledge the first delivery only, then drop.
	{
		s := &session{}
		sessions = append(sessions, s)
		ctx, cancel := context.WithCancel(context.Background())
		stream := open(client, ctx, clientID, 0)
		var jobs []*rolloutv1.JobSpec
		for i := 0; i < 2; i++ {
			task, _ := structpb.NewStruct(map[string]interface{}{"reward": 0.5 * float64(i+1)})
			jobs = append(jobs, &rolloutv1.JobSpec{
				JobId: fmt.Sprintf("go-group/%d", i), Environment: "scripted", Task: task,
				Group: &rolloutv1.GroupSpec{GroupId: "go-group", Size: 2}})
		}
		err := stream.Send(&rolloutv1.StreamRolloutsRequest{Kind: &rolloutv1.StreamRolloutsRequest_Submit{
			Submit: &rolloutv1.SubmitJobs{Jobs: jobs}}})
		if err != nil {
			fail(err)
		}
		for {
			frame, err := stream.Recv()
			if err != nil {
				s.EndedWith = err.Error()
				break
			}
			switch k := frame.Kind.(type) {
			case *rolloutv1.StreamRolloutsResponse_Opened:
				s.Replaying = k.Opened.Replaying
			case *rolloutv1.StreamRolloutsResponse_Accepted:
				s.Accepted = append(s.Accepted, frame.JobId)
			case *rolloutv1.StreamRolloutsResponse_Trajectory:
				d := k.Trajectory
				s.Deliveries = append(s.Deliveries, delivery{frame.JobId, d.DeliveryId, d.Trajectory.Reward})
				if len(s.Deliveries) == 1 {
					ack(stream, d.DeliveryId)
				}
			case *rolloutv1.StreamRolloutsResponse_Finished:
				s.Finished = append(s.Finished, frame.JobId)
			case *rolloutv1.StreamRolloutsResponse_Heartbeat:
				if len(s.Finished) == 2 && k.Heartbeat.AckedThrough == 1 {
					s.AckedThrough = k.Heartbeat.AckedThrough
					cancel() // abrupt drop: the second delivery stays unacknowledged
				}
			}
		}
		cancel()
	}

	// Session 2: resume with acked_through 1; the second delivery is replayed.
	{
		s := &session{}
		sessions = append(sessions, s)
		stream := open(client, context.Background(), clientID, 1)
		for {
			frame, err := stream.Recv()
			if err == io.EOF {
				s.EndedWith = "ok"
				break
			}
			if err != nil {
				fail(err)
			}
			switch k := frame.Kind.(type) {
			case *rolloutv1.StreamRolloutsResponse_Opened:
				s.Replaying = k.Opened.Replaying
			case *rolloutv1.StreamRolloutsResponse_Trajectory:
				d := k.Trajectory
				s.Deliveries = append(s.Deliveries, delivery{frame.JobId, d.DeliveryId, d.Trajectory.Reward})
				ack(stream, d.DeliveryId)
			case *rolloutv1.StreamRolloutsResponse_Finished:
				s.Finished = append(s.Finished, frame.JobId)
			case *rolloutv1.StreamRolloutsResponse_Heartbeat:
				hb := k.Heartbeat
				if hb.AckedThrough == 2 && hb.Unacked == 0 && hb.JobsInFlight == 0 && s.AckedThrough == 0 {
					s.AckedThrough = hb.AckedThrough
					if err := stream.CloseSend(); err != nil { // half-close: the call ends OK
						fail(err)
					}
				}
			}
		}
	}
	out, _ := json.Marshal(map[string]interface{}{"sessions": sessions})
	fmt.Println(string(out))
}
